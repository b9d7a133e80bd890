"""Token streams already on disk to a block-aligned MDS dataset: the core of bin_to_mds.py.

The files are concatenated in the order given; the output stream equals the input stream, cut
into samples exactly as text conversion cuts it (the same SplitWriter). Memory stays at one chunk
plus one shard. Local outputs resume after a kill: completed shards are journaled, and a rerun
verifies them and continues from the first sample they do not hold; a finished split is not redone.
"""

import mmap
import os
import tempfile
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from tokstream.convert.dataset_writer import SplitWriter
from tokstream.convert.options import ConversionOptions
from tokstream.convert.remote_token_files import Fetcher, RemoteTokenFile
from tokstream.convert.resume import (SplitState, discard_split_stats, file_stamp, finished_split_stats, read_journal,
                              save_split_stats, token_files_resume_key)
from tokstream.convert.staging import staged_output
from tokstream.convert.token_files import TokenFile, check_chunk
from tokstream.errors import UserError
from tokstream.format import METADATA_FILE, DatasetMetadata, SplitStats, read_metadata, token_dtype, write_metadata
from tokstream.object_store import is_s3

CHUNK_TOKENS = 1 << 24  # 32 MB of uint16 per read


@dataclass(frozen=True)
class Vocabulary:
    """What token files need of their tokenizer: the range of ids and the document separator."""

    name: str  # the tokenizer's, or vocab-N when only --vocab-size describes it
    sha256: str | None  # of the tokenizer's file, when there is one
    size: int
    separator_id: int
    separator_position: str  # after or before each document

    @classmethod
    def of(cls, tokenizer) -> "Vocabulary":
        return cls(tokenizer.name, tokenizer.sha256, tokenizer.vocab_size, tokenizer.separator_id,
                   tokenizer.separator_position)


def _release_pages(tokens: np.ndarray) -> None:
    """Drop the mapped pages already read from this process's RSS (they stay in the page cache)."""
    mapping = getattr(tokens, "_mmap", None)  # numpy.memmap keeps its mmap.mmap here
    if mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
        mapping.madvise(mmap.MADV_DONTNEED)


def pack_token_files(files: list[TokenFile | RemoteTokenFile], name: str, directory: Path, metadata: DatasetMetadata,
                     options: ConversionOptions, on_file=None, resumable: bool = False) -> SplitStats:
    """Write split `name` from the files' concatenated tokens into `directory`."""
    if resumable and (stats := finished_split_stats(directory)) is not None:
        return stats
    split = SplitWriter(name, directory, metadata, options, on_file, journal=resumable)
    done = read_journal(directory) if resumable else []
    skip = sum(shard["samples"] for shard in done) * metadata.block_size  # first token of the next sample
    if done:
        split.load_state_dict(SplitState(shards=done, documents=0, tokens=skip, samples=skip // metadata.block_size,
                                         buffered=np.empty((0, metadata.sample_length), metadata.np_dtype),
                                         pending=np.empty(0, metadata.np_dtype)))
        print(f"resuming {directory.name}: {len(done)} shards verified, continuing at token {skip:,}")
    remote = any(isinstance(f, RemoteTokenFile) for f in files)
    fetcher = Fetcher(Path(tempfile.mkdtemp(prefix="tokstream-fetch-", dir=options.staging_dir)),
                      say=tqdm.write) if remote else None
    total = None if remote else sum(len(f.tokens) for f in files)
    try:
        with tqdm(total=total, unit="tok", unit_scale=True, desc="packing", disable=not options.progress,
                  delay=2) as bar:
            offset = 0  # of the current file in the concatenated stream
            for index, item in enumerate(files):
                if isinstance(item, RemoteTokenFile):
                    if skip and offset + (length := item.token_count()) <= skip:  # all in verified shards
                        offset += length
                        continue
                    following = next((f for f in files[index + 1:] if isinstance(f, RemoteTokenFile)), None)
                    opened = fetcher.opened(item, following)
                else:
                    opened = nullcontext(item)
                with opened as token_file:
                    _pack_file(token_file, split, metadata, offset, skip, bar)
                    offset += len(token_file.tokens)
    finally:
        if fetcher is not None:
            fetcher.close()
    if split.packer.samples == 0:
        raise UserError(f"{split.packer.tokens} tokens in all inputs: fewer than one sample of block_size + 1 = "
                        f"{metadata.block_size + 1}")
    stats = split.finish()
    if resumable:
        save_split_stats(directory, stats)
    return stats


def _pack_file(token_file: TokenFile, split: SplitWriter, metadata: DatasetMetadata, offset: int, skip: int,
               bar: tqdm) -> None:
    """Add one file's tokens from `skip` on (of the concatenated stream, where this file starts at `offset`)."""
    for start in range(0, len(token_file.tokens), CHUNK_TOKENS):
        chunk = np.asarray(token_file.tokens[start : start + CHUNK_TOKENS])
        check_chunk(chunk, metadata.vocab_size, token_file, start)
        documents = int(np.count_nonzero(chunk == metadata.separator_id))
        first_new = max(0, skip - (offset + start))  # tokens already in verified shards
        split.add(chunk[first_new:], documents)
        bar.update(len(chunk))
        _release_pages(token_file.tokens)


def convert_token_files(files_by_split: dict[str, list[TokenFile | RemoteTokenFile]], out: str, vocabulary: Vocabulary,
                        options: ConversionOptions) -> DatasetMetadata:
    """Write dataset `out` with these splits; into an existing local dataset, add (or replace) them.

    E.g. train.bin and val.bin in one call, or train now and val later into the same local root.
    """
    if not all(files_by_split.values()):
        raise UserError("no input files")
    if not 0 <= vocabulary.separator_id < vocabulary.size:
        raise UserError(f"separator id {vocabulary.separator_id} is outside the vocabulary (size {vocabulary.size})")
    metadata = DatasetMetadata(
        tokenizer=vocabulary.name, tokenizer_sha256=vocabulary.sha256, vocab_size=vocabulary.size,
        separator_id=vocabulary.separator_id, separator_position=vocabulary.separator_position,
        block_size=options.block_size, dtype=token_dtype(vocabulary.size).name,
        source={"kind": "token-files", "splits": {
            split: {"files": [str(f.path) for f in files], "formats": [f.format for f in files]}
            for split, files in files_by_split.items()}},
        split={"method": "given", "note": "splits named on the command line; documents counted as separator tokens"},
    )
    root = Path(out)
    if not is_s3(out) and (root / METADATA_FILE).is_file() and not options.overwrite:
        return _add_local_splits(files_by_split, root, metadata, options)
    key = None if is_s3(out) else _resume_key(files_by_split, metadata, options)
    with staged_output(out, options.overwrite, options.staging_dir, resume_key=key) as staging:
        for split, files in files_by_split.items():
            metadata.splits[split] = pack_token_files(files, split, staging.path / split, metadata, options,
                                                      staging.on_file, resumable=key is not None)
            discard_split_stats(staging.path / split)
        write_metadata(staging.path, metadata)
    return metadata


def _resume_key(files_by_split: dict[str, list[TokenFile]], metadata: DatasetMetadata,
                options: ConversionOptions) -> dict:
    inputs = {split: [(str(f.path), f.stamp() if isinstance(f, RemoteTokenFile) else file_stamp(f.path), f.format)
                      for f in files] for split, files in files_by_split.items()}
    return token_files_resume_key(inputs, {"block_size": options.block_size, "vocab_size": metadata.vocab_size,
                                           "separator": [metadata.separator_id, metadata.separator_position],
                                           **options.writer_settings})


def _add_local_splits(files_by_split: dict[str, list[TokenFile]], root: Path, metadata: DatasetMetadata,
                      options: ConversionOptions) -> DatasetMetadata:
    existing = read_metadata(root)
    for key in ("tokenizer", "tokenizer_sha256", "vocab_size", "separator_id", "separator_position", "block_size",
                "dtype"):
        if getattr(existing, key) != getattr(metadata, key):
            raise UserError(f"{root} holds {key}={getattr(existing, key)!r}, this conversion "
                            f"{getattr(metadata, key)!r}: use another --out")
    if existing.source.get("kind") != "token-files":
        raise UserError(f"{root} was converted from {existing.source.get('kind')}, not token files: "
                        "use another --out")
    for split in files_by_split:
        if split in existing.splits:
            raise UserError(f"{root} already has a {split} split: pass --overwrite to rewrite the whole dataset")
    existing.source["splits"].update(metadata.source["splits"])
    for split, files in files_by_split.items():
        key = _resume_key({split: files}, metadata, options)
        with staged_output(root / split, False, resume_key=key) as staging:
            existing.splits[split] = pack_token_files(files, split, staging.path, existing, options, resumable=True)
            discard_split_stats(staging.path)
    temporary = root / (METADATA_FILE + ".tmp")
    temporary.write_text(existing.to_json())
    os.replace(temporary, root / METADATA_FILE)  # the new split is visible to training only from here
    return existing
