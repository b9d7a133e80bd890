"""Optional document cleaning for plain-text corpora: Unicode/whitespace normalisation, exact dedup.

Dedup keeps the first occurrence of each exact document text (after normalisation). Memory is
bounded and stated up front: each document costs one 8-byte slot of a fixed-size open-addressing
table of 64-bit BLAKE2b fingerprints (`--dedup-memory`, default 1 GiB = 134 M slots, filled to at
most 70%). A full table stops the conversion with a message rather than growing. Two different
documents share a 64-bit fingerprint with probability about n²/2⁶⁵ (3·10⁻⁴ for 100 M documents).
"""

import hashlib
import re
import unicodedata
from dataclasses import dataclass

import numpy as np

from tokstream.errors import UserError

NORMALIZE_MODES = ("none", "nfc", "nfc+whitespace")
MAX_LOAD = 0.7
_SPACES = re.compile(r"[ \t\f\v]+")
_TRAILING = re.compile(r"[ \t]+\n")
_BLANK_LINES = re.compile(r"\n{3,}")


def fingerprint(text: str) -> int:
    """A non-zero 64-bit fingerprint of a document (0 marks an empty table slot)."""
    value = int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")
    return value or 1


class FingerprintSet:
    """A fixed-capacity set of 64-bit fingerprints: 8 bytes a slot, linear probing."""

    def __init__(self, memory_bytes: int):
        self.slots = max(1024, memory_bytes // 8)
        self.table = np.zeros(self.slots, dtype=np.uint64)
        self.count = 0

    def add(self, value: int) -> bool:
        """Insert; return False if it was already present."""
        index = value % self.slots
        table = self.table
        while True:
            current = int(table[index])
            if current == value:
                return False
            if current == 0:
                if self.count >= MAX_LOAD * self.slots:
                    raise UserError(f"dedup table full after {self.count:,} documents: raise --dedup-memory "
                                    f"(now {self.slots * 8 / 2**30:.2f} GiB)")
                table[index] = value
                self.count += 1
                return True
            index = (index + 1) % self.slots


def normalize(text: str, mode: str) -> str:
    if mode == "none":
        return text
    text = unicodedata.normalize("NFC", text)
    if mode == "nfc+whitespace":
        text = _SPACES.sub(" ", text.replace("\r\n", "\n").replace("\r", "\n"))
        text = _BLANK_LINES.sub("\n\n", _TRAILING.sub("\n", text)).strip()
    return text


@dataclass(frozen=True)
class Cleaning:
    """What to do to documents before tokenizing; the default leaves them exactly as read."""

    normalize: str = "none"
    drop_empty: bool = False
    dedup_memory: int | None = None  # bytes of the dedup table; None: no dedup

    def __post_init__(self) -> None:
        if self.normalize not in NORMALIZE_MODES:
            raise UserError(f"--normalize must be one of {', '.join(NORMALIZE_MODES)}, not {self.normalize!r}")

    def describe(self) -> dict:
        return {"normalize": self.normalize, "drop_empty": self.drop_empty, "dedup": bool(self.dedup_memory)}


@dataclass
class CleaningStats:
    empty: int = 0  # documents dropped for being empty (after normalisation)
    duplicates: int = 0  # documents dropped as exact repeats of an earlier one


def clean_texts(texts: list[str], cleaning: Cleaning) -> tuple[list[str], int]:
    """The texts normalised, without the empty ones if asked; and how many were dropped as empty.

    Per document, so it runs in the tokenizer processes; dedup (one table for the whole input) does not."""
    kept = []
    for text in texts:
        text = normalize(text, cleaning.normalize)
        if cleaning.drop_empty and not text.strip():
            continue
        kept.append(text)
    return kept, len(texts) - len(kept)
