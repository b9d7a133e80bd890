"""The settings of a conversion, shared by every converter; checked once, when they are made."""

import os
from dataclasses import dataclass, field

from tokstream.errors import UserError
from tokstream.format import SPLITS, parse_size


@dataclass(frozen=True)
class ConversionOptions:
    # How samples are written (every converter).
    block_size: int = 1024
    shard_size: str = "64mb"
    compression: str | None = None
    hashes: tuple[str, ...] = ("xxh64",)
    overwrite: bool = False
    progress: bool = True
    staging_dir: str | None = None  # local scratch for S3 outputs (default: the system temp dir)
    # How text becomes documents and splits (text converters).
    val_fraction: float = 0.0005
    seed: int = 2357
    num_workers: int = field(default_factory=lambda: os.cpu_count() or 1)
    max_docs: int | None = None
    state_interval_s: float = 60.0  # how often a one-pass conversion saves its state for resuming

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise UserError(f"--block-size must be at least 1, got {self.block_size}")
        if not 0 <= self.val_fraction < 1:
            raise UserError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.max_docs is not None and self.max_docs < 1:
            raise UserError(f"--max-docs must be at least 1, got {self.max_docs}")
        parse_size(self.shard_size)  # one line now rather than after tokenizing

    @property
    def text_splits(self) -> tuple[str, ...]:
        """The splits a text conversion writes: val only with a val fraction."""
        return SPLITS if self.val_fraction > 0 else ("train",)

    @property
    def writer_settings(self) -> dict:
        """The settings that decide the shards' bytes (part of every resume key)."""
        return {"shard_size": str(self.shard_size), "compression": self.compression,
                "hashes": sorted(self.hashes)}
