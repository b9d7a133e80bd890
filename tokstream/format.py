"""Shared: the on-disk format, owned here and nowhere else (converters write it; the reader, Grain, verify read).

A dataset root holds one plain MDS dataset per split plus a metadata record:

    ROOT/metadata.json          this module's schema (FORMAT_NAME, FORMAT_VERSION)
    ROOT/train/index.json       stock MDS index, read by streaming.StreamingDataset
    ROOT/train/shard.00000.mds  ...
    ROOT/val/...                (absent when the val fraction is 0)

Every MDS sample has one column, `tokens`: a fixed-length array of
`block_size + 1` token ids, encoded `ndarray:<dtype>:<block_size + 1>` so the
sample carries no per-sample header. Sample k holds stream tokens
[k*B, k*B + B] inclusive: consecutive samples overlap by one token, inputs are
`tokens[:-1]` and targets `tokens[1:]`, so every token after the first is a
target exactly once. The dtype is uint16 when every id fits, else uint32.

The stream is the documents' tokens in order, each with the separator token
`separator_id`: after the document (`separator_position` "after": GPT-2's
end-of-text) or before it ("before": Llama-3's begin-of-text). The metadata
names the tokenizer and the sha256 of its file (none for token files converted
without one). Version 1 (no separator fields: an end-of-text `eot_id` after
each document) is read as version 2.
"""

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from tokstream.errors import UserError

FORMAT_NAME = "tokstream-mds"
FORMAT_VERSION = 2
SEPARATOR_POSITIONS = ("after", "before")
METADATA_FILE = "metadata.json"
TOKENS_COLUMN = "tokens"
SPLITS = ("train", "val")


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every id of the vocabulary."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def sample_length(block_size: int) -> int:
    """Tokens stored per sample: one more than the block, for the shifted targets."""
    return block_size + 1


def column_encoding(dtype: np.dtype, block_size: int) -> str:
    """The MDS encoding of the tokens column: static dtype and shape, so no per-sample header."""
    return f"ndarray:{np.dtype(dtype).name}:{sample_length(block_size)}"


def parse_column_encoding(encoding: str) -> tuple[np.dtype, int]:
    """The token dtype and sample length of a tokens column encoding (the inverse of column_encoding)."""
    kind, dtype, length = encoding.split(":")
    if kind != "ndarray":
        raise ValueError(f"column encoding {encoding!r} is not this format's ndarray:<dtype>:<length>")
    return np.dtype(dtype), int(length)


@dataclass
class SplitStats:
    """Counts for one split, filled in while it is written."""

    documents: int = 0
    tokens: int = 0
    samples: int = 0
    dropped_tokens: int = 0  # tail tokens that never became a target
    shards: int = 0
    bytes: int = 0


@dataclass
class DatasetMetadata:
    """The record training checks its config against; one per dataset root."""

    tokenizer: str  # its name: a tiktoken encoding, a tokenizer.json or hub name, or what --vocab-size described
    tokenizer_sha256: str | None  # of the tokenizer's file; None when converted from token files without one
    vocab_size: int
    separator_id: int  # the document separator
    separator_position: str  # "after" each document or "before" it
    block_size: int
    dtype: str
    source: dict
    split: dict  # how documents were assigned to splits: method, seed, val_fraction
    splits: dict[str, SplitStats] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # converter-specific facts (dropped docs, repairs)
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION
    column: str = TOKENS_COLUMN

    @property
    def sample_length(self) -> int:
        return sample_length(self.block_size)

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str = "metadata") -> "DatasetMetadata":
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as err:
            raise UserError(f"{where} is not valid JSON: {err}") from None
        if raw.get("format") != FORMAT_NAME:
            raise UserError(f"{where} is not a {FORMAT_NAME} dataset (format={raw.get('format')!r})")
        if raw.get("format_version") not in (1, FORMAT_VERSION):
            raise UserError(
                f"{where} has format version {raw.get('format_version')}, this code reads "
                f"versions 1 and {FORMAT_VERSION}: reconvert the data or use a matching release"
            )
        try:
            if raw["format_version"] == 1:  # an end-of-text after each document, no tokenizer hash
                raw.update(format_version=FORMAT_VERSION, separator_id=raw.pop("eot_id"), separator_position="after",
                           tokenizer_sha256=None)
            raw["splits"] = {name: SplitStats(**stats) for name, stats in raw["splits"].items()}
            metadata = cls(**raw)
        except (KeyError, TypeError, AttributeError) as err:  # a field missing, unknown or of the wrong kind
            raise UserError(f"{where} is damaged or hand-edited ({type(err).__name__}: {err}): "
                            "restore it from the conversion or reconvert") from None
        if metadata.separator_position not in SEPARATOR_POSITIONS:
            raise UserError(f"{where}: separator_position {metadata.separator_position!r} is neither "
                            f"{' nor '.join(SEPARATOR_POSITIONS)}: restore it from the conversion or reconvert")
        return metadata


def write_metadata(root: str | os.PathLike, metadata: DatasetMetadata) -> None:
    Path(root, METADATA_FILE).write_text(metadata.to_json())


def read_metadata(root: str | os.PathLike) -> DatasetMetadata:
    path = Path(root, METADATA_FILE)
    if not path.is_file():
        raise UserError(f"{root} has no {METADATA_FILE}: not a dataset written by this project's converters")
    return DatasetMetadata.from_json(path.read_text(), where=str(path))


def check_compatible(metadata: DatasetMetadata, vocab_size: int, block_size: int, where: str) -> None:
    """Refuse a dataset whose tokens or sample length do not fit the model."""
    if metadata.vocab_size > vocab_size:
        raise UserError(f"{where}: dataset vocab_size {metadata.vocab_size} > model vocab_size "
                        f"{vocab_size}; set model.vocab_size >= {metadata.vocab_size}")
    if metadata.block_size != block_size:
        raise UserError(f"{where}: dataset block_size {metadata.block_size} != model block_size "
                        f"{block_size}; set model.block_size={metadata.block_size} or reconvert "
                        f"with --block-size {block_size}")
    if metadata.np_dtype != token_dtype(metadata.vocab_size):
        raise UserError(f"{where}: dtype {metadata.dtype} does not match vocab_size {metadata.vocab_size}")


class BlockPacker:
    """Cuts a token stream, fed in pieces, into overlapping samples of block_size + 1 tokens."""

    def __init__(self, block_size: int, dtype: np.dtype):
        if block_size < 1:
            raise UserError(f"block size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.dtype = np.dtype(dtype)
        self.pending = np.empty(0, dtype=self.dtype)
        self._buffer = np.empty(0, dtype=self.dtype)
        self.tokens = 0
        self.samples = 0

    def add(self, tokens: np.ndarray) -> np.ndarray:
        """Every sample completed by these tokens, as a (count, block_size + 1) strided view.

        The view is only valid until the next call: write it before adding more.
        """
        self.tokens += len(tokens)
        size = len(self.pending) + len(tokens)
        if len(self._buffer) < size:  # grow rarely: fresh memory costs a page fault per 4 KB
            self._buffer = np.empty(max(size, 2 * len(self._buffer)), dtype=self.dtype)
        stream = self._buffer[:size]
        stream[: len(self.pending)] = self.pending
        stream[len(self.pending) :] = tokens
        count = max(0, (size - 1) // self.block_size)
        if count:
            windows = np.lib.stride_tricks.sliding_window_view(stream, self.block_size + 1)
            samples = windows[: count * self.block_size : self.block_size]
        else:
            samples = np.empty((0, self.block_size + 1), dtype=self.dtype)
        self.samples += count
        # The last token of a sample is the first of the next one; copied out, as the buffer is reused.
        self.pending = stream[count * self.block_size :].copy()
        return samples

    def state_dict(self) -> dict:
        """Counts so far and the tokens held towards the next sample."""
        return {"tokens": self.tokens, "samples": self.samples, "pending": self.pending.copy()}

    def load_state_dict(self, state: dict) -> None:
        self.tokens, self.samples = state["tokens"], state["samples"]
        self.pending = np.asarray(state["pending"], dtype=self.dtype)

    @property
    def dropped_tokens(self) -> int:
        """Tokens left over at the end that no sample uses as a target."""
        return len(self.pending) - 1 if self.samples else len(self.pending)


def shard_samples(data: bytes | np.ndarray, dtype: np.dtype, length: int, every_offset: bool = True) -> np.ndarray:
    """View a decompressed MDS shard of this format as a (samples, length) token array.

    MDS shard layout: uint32 sample count n, n + 1 uint32 byte offsets, the
    writer's JSON config, then the samples back to back; with one fixed-size
    column each sample is exactly its tokens.

    `every_offset=False` checks only the first and last offsets, which are all the view uses: for a
    reader of a mapped shard, whose other offsets are 128 KB of a 64 MB shard read from disk for
    nothing (a few ms per shard on a cold cache, and a first batch maps a dozen shards). The
    checker (verify.py) checks every one.
    """
    buffer = np.frombuffer(data, dtype=np.uint8)
    count = int(buffer[:4].view(np.uint32)[0])
    offsets = buffer[4 : 4 + 4 * (count + 1)].view(np.uint32)
    sample_bytes = length * np.dtype(dtype).itemsize
    if count and every_offset and not np.all(np.diff(offsets) == sample_bytes):
        raise ValueError(f"samples are not {sample_bytes} bytes each")
    begin = int(offsets[0])
    end = begin + count * sample_bytes
    if end > len(buffer) or int(offsets[-1]) != end:
        raise ValueError(f"shard is truncated: offsets end at {int(offsets[-1])}, file has {len(buffer)} bytes")
    return buffer[begin:end].view(dtype).reshape(count, length)


def shard_sample_count(path: str | os.PathLike) -> int:
    """The sample count in an uncompressed shard's header (its first uint32, little-endian as MDS writes
    it), read without the rest of the file."""
    fd = os.open(path, os.O_RDONLY)  # not open(): at tens of thousands of shards its layers cost more than the read
    try:
        return int.from_bytes(os.pread(fd, 4, 0), "little")
    finally:
        os.close(fd)


# How MDS (streaming's format, version 2) names shard hashes; the same digests streaming computes.
def _hasher(algo: str):
    import xxhash

    return getattr(xxhash, algo)() if algo.startswith("xxh") else hashlib.new(algo)


def file_hash(algo: str, *pieces: bytes | memoryview) -> str:
    """The digest MDS records for a file whose bytes are the concatenation of `pieces`."""
    hasher = _hasher(algo)
    for piece in pieces:
        hasher.update(piece)
    return hasher.hexdigest()

class ShardWriter:
    """Writes one split's samples as MDS shards plus index.json, whole arrays at a time.

    The bytes are exactly those of `streaming.MDSWriter` given the same samples, column and
    settings (tests/test_format.py holds the two side by side). It exists because `import
    streaming` imports torch: 7 s and 870 MB per process, which would otherwise dominate a
    conversion; and because it takes a whole array of samples per call, not one dict per sample.
    """

    MDS_EXTRA_BYTES_PER_SAMPLE = 4  # MDS counts one uint32 offset per sample towards the size limit

    def __init__(self, directory: str | os.PathLike, metadata: DatasetMetadata, shard_size: str | int,
                 compression: str | None = None, hashes: list[str] = (), on_file=None, journal=None):
        self.directory = Path(directory)
        self.on_file = on_file  # told of each finished shard file (an uploader, say)
        self.journal = journal  # told of each finished shard's index entry (resume.ShardJournal)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.dtype = metadata.np_dtype
        self.length = metadata.sample_length
        self.sample_bytes = self.length * self.dtype.itemsize
        self.compression = compression or None
        self.hashes = sorted(hashes)
        self.config = {
            "column_encodings": [column_encoding(self.dtype, metadata.block_size)],
            "column_names": [metadata.column],
            "column_sizes": [self.sample_bytes],
            "compression": self.compression,
            "format": "mds",
            "hashes": self.hashes,
            "size_limit": parse_size(shard_size),
            "version": 2,
        }
        self.config_bytes = json.dumps(self.config, sort_keys=True).encode("utf-8")
        room = self.config["size_limit"] - 8 - len(self.config_bytes)
        self.samples_per_shard = room // (self.sample_bytes + self.MDS_EXTRA_BYTES_PER_SAMPLE)
        if self.samples_per_shard < 1:
            raise UserError(f"shard size {shard_size} is smaller than one sample ({self.sample_bytes} bytes)")
        if self.compression and self.compression.partition(":")[0] != "zstd":
            raise UserError(f"compression {self.compression!r} is not supported; use zstd or zstd:LEVEL")
        # One shard's samples, reused shard after shard: each token is copied once on its way to disk.
        self.body = np.empty((self.samples_per_shard, self.length), dtype=self.dtype)
        self.pending_count = 0
        self.shards: list[dict] = []

    def state_dict(self) -> dict:
        """The finished shards' index entries and a copy of the samples buffered towards the next one."""
        return {"shards": list(self.shards), "buffered": self.body[: self.pending_count].copy()}

    def load_state_dict(self, state: dict) -> None:
        """Continue after those shards (their files must be in place), with those samples buffered."""
        self.shards = list(state["shards"])
        self.pending_count = 0
        self.write(state["buffered"])  # fewer than a shard: buffered, not written

    def write(self, samples: np.ndarray) -> None:
        """Append a (count, block_size + 1) array of samples; full shards go to disk at once."""
        while len(samples):
            take = min(len(samples), self.samples_per_shard - self.pending_count)
            self.body[self.pending_count : self.pending_count + take] = samples[:take]
            self.pending_count += take
            samples = samples[take:]
            if self.pending_count == self.samples_per_shard:
                self._flush()

    def _flush(self) -> None:
        count = self.pending_count
        header_bytes = 4 + 4 * (count + 1) + len(self.config_bytes)
        offsets = header_bytes + np.arange(count + 1, dtype=np.uint64) * self.sample_bytes
        header = np.uint32(count).tobytes() + offsets.astype(np.uint32).tobytes() + self.config_bytes
        body = memoryview(self.body[:count]).cast("B")
        basename = f"shard.{len(self.shards):05}.mds"
        shard = {"samples": count, "raw_data": self._file_info(basename, header, body), "zip_data": None}
        pieces = (header, body)
        if self.compression:
            import zstd

            level = self.compression.partition(":")[2]
            pieces = (zstd.compress(header + bytes(body), int(level or 3)),)  # as streaming's Zstandard does
            shard["zip_data"] = self._file_info(f"{basename}.zstd", *pieces)
        shard.update(self.config)
        path = self.directory / stored_file(shard)["basename"]
        with open(path, "wb") as out:
            for piece in pieces:
                out.write(piece)
        if self.journal is not None:
            self.journal.record(shard)
        if self.on_file is not None:
            self.on_file(path)
        self.shards.append(shard)
        self.pending_count = 0

    def _file_info(self, basename: str, *pieces: bytes | memoryview) -> dict:
        return {"basename": basename, "bytes": sum(len(p) for p in pieces),
                "hashes": {a: file_hash(a, *pieces) for a in self.hashes}}

    def finish(self) -> None:
        """Write the last shard and then the index: a split without index.json is unfinished."""
        if self.pending_count:
            self._flush()
        with open(self.directory / "index.json", "w") as out:
            json.dump({"shards": self.shards, "version": 2}, out, sort_keys=True)
        if self.journal is not None:
            self.journal.discard()


def index_shards(split_directory: str | os.PathLike) -> list[dict]:
    """The index.json entries of a split's shards."""
    return json.loads((Path(split_directory) / "index.json").read_text())["shards"]


def stored_file(shard: dict) -> dict:
    """An index entry's file as it lies on disk: the compressed one when there is one."""
    return shard["zip_data"] or shard["raw_data"]


def shard_file_intact(directory: str | os.PathLike, shard: dict) -> bool:
    """Whether the file an index entry names is on disk with its recorded size and hashes."""
    stored = stored_file(shard)
    file = Path(directory) / stored["basename"]
    if not file.is_file() or file.stat().st_size != stored["bytes"]:
        return False
    return all(file_hash(algo, file.read_bytes()) == digest for algo, digest in stored["hashes"].items())


def parse_size(size: str | int) -> int:
    """'64mb' -> bytes, with binary multiples as MDS reads them."""
    if isinstance(size, int):
        return size
    text = size.strip().lower().removesuffix("b") or "0"
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    try:
        return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)
    except ValueError:
        raise UserError(f"cannot read shard size {size!r}; use e.g. 64mb") from None


def decompress_shard(compression: str, data: bytes) -> bytes:
    if not compression.startswith("zstd"):
        raise UserError(f"shard compression {compression!r} is not supported; this format writes zstd")
    import zstd

    return zstd.decompress(data)
