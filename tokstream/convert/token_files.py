"""Existing token files, memory-mapped: nanoGPT .bin, llm.c/modded-nanogpt shards, .npy arrays.

- nanoGPT `train.bin`/`val.bin`: headerless little-endian uint16.
- llm.c shards: 256 little-endian int32 header (magic, version, token count, unused...), then the
  tokens: magic 20240520 / version 1 for GPT-2 (uint16), 20240801 / version 7 for Llama-3 (uint32,
  each document led by <|begin_of_text|>, 128000). llm.c's evaluation files (magic 20240522, HellaSwag
  examples) and files with an llm.c-style header of another magic are refused, named for what they are.
- `.npy`: a 1-D array of any integer dtype.
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokstream.errors import UserError

LLMC_HEADER_INTS = 256
LLMC_VERSIONS = {20240520: (1, np.dtype("<u2")), 20240801: (7, np.dtype("<u4"))}
LLMC_LLAMA3_MAGIC = 20240801
LLMC_EVAL_MAGIC = 20240522  # dev/data/hellaswag.py's evaluation examples, not a token stream
FORMATS = ("auto", "nanogpt", "llmc", "npy")


@dataclass
class TokenFile:
    path: Path
    format: str
    tokens: np.ndarray  # 1-D, memory-mapped: never read whole

    @property
    def is_llama3_llmc(self) -> bool:
        return self.format == "llmc" and self.tokens.dtype.itemsize == 4


def detect_format(path: Path) -> str:
    if path.suffix == ".npy":
        return "npy"
    header = np.fromfile(path, dtype="<i4", count=LLMC_HEADER_INTS)
    magic = int(header[0]) if len(header) else None
    if magic in LLMC_VERSIONS:
        return "llmc"
    if magic == LLMC_EVAL_MAGIC:
        raise UserError(f"{path} is an llm.c evaluation file (magic {magic}: HellaSwag examples), not token data; "
                        "convert the train/val token shards instead")
    size, count = path.stat().st_size, int(header[2]) if len(header) == LLMC_HEADER_INTS else -1
    if count >= 0 and size in (LLMC_HEADER_INTS * 4 + count * 2, LLMC_HEADER_INTS * 4 + count * 4):
        raise UserError(f"{path} has an llm.c-style header (its token count matches the file size) with magic "
                        f"{magic}, which this converter does not know ({' or '.join(map(str, LLMC_VERSIONS))}); "
                        "pass --format nanogpt if it really is a headerless uint16 file")
    return "nanogpt"


def open_token_file(path: str | Path, fmt: str = "auto") -> TokenFile:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path} does not exist")
    if fmt not in FORMATS:
        raise UserError(f"--format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    fmt = detect_format(path) if fmt == "auto" else fmt
    size = path.stat().st_size
    if fmt == "nanogpt":
        if size % 2:
            raise UserError(f"{path}: {size} bytes is odd, not a uint16 token file (truncated or another format?)")
        tokens = np.memmap(path, dtype="<u2", mode="r") if size else np.empty(0, np.uint16)
    elif fmt == "llmc":
        tokens = _open_llmc(path, size)
    else:
        try:
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        except Exception as err:
            raise UserError(f"{path}: not a readable .npy file: {err}") from None
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise UserError(f"{path}: expected a 1-D integer array, got shape {tokens.shape} dtype {tokens.dtype}")
    return TokenFile(path, fmt, tokens)


def _open_llmc(path: Path, size: int) -> np.ndarray:
    header_bytes = LLMC_HEADER_INTS * 4
    if size < header_bytes:
        raise UserError(f"{path}: {size} bytes is shorter than the llm.c header ({header_bytes} bytes)")
    header = np.fromfile(path, dtype="<i4", count=LLMC_HEADER_INTS)
    magic, version, count = int(header[0]), int(header[1]), int(header[2])
    if magic not in LLMC_VERSIONS:
        raise UserError(f"{path}: bad magic {magic} at offset 0; llm.c shards start with "
                        f"{' or '.join(map(str, LLMC_VERSIONS))}")
    expected_version, dtype = LLMC_VERSIONS[magic]
    if version != expected_version:
        raise UserError(f"{path}: version {version} at offset 4, expected {expected_version} for magic {magic}")
    if header_bytes + count * dtype.itemsize != size:
        raise UserError(f"{path}: header (offset 8) says {count} tokens = {header_bytes + count * dtype.itemsize} "
                        f"bytes with the header, the file has {size} bytes")
    return np.memmap(path, dtype=dtype, mode="r", offset=header_bytes, shape=(count,))


def check_chunk(chunk: np.ndarray, vocab_size: int, token_file: TokenFile, start: int) -> None:
    """Refuse ids that are negative or outside the vocabulary, naming file and token offset."""
    if not len(chunk):
        return
    if np.issubdtype(chunk.dtype, np.signedinteger) and chunk.min() < 0:
        offset = start + int(np.argmax(chunk < 0))
        raise UserError(f"{token_file.path}: negative token id {int(chunk[offset - start])} at token {offset}")
    if int(chunk.max()) >= vocab_size:
        offset = start + int(np.argmax(chunk >= vocab_size))
        raise UserError(f"{token_file.path}: token id {int(chunk[offset - start])} at token {offset} is outside "
                        f"the vocabulary (size {vocab_size}); wrong --tokenizer (or --vocab-size), or not token ids?")
