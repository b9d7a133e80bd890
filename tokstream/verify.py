"""Checking a dataset against its index, its hashes and this project's format rules."""

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tokstream.errors import UserError
from tokstream.format import (DatasetMetadata, column_encoding, decompress_shard, file_hash, read_metadata,
                              shard_samples)


@dataclass
class SplitReport:
    shards: int = 0
    samples: int = 0
    bytes: int = 0
    eot_tokens: int = 0  # end-of-text tokens among the split's distinct stream positions


@dataclass
class VerifyReport:
    metadata: DatasetMetadata
    splits: dict[str, SplitReport] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _read_index(split_dir: Path) -> dict:
    path = split_dir / "index.json"
    if not path.is_file():
        raise UserError(f"{path} is missing: the split was never finished")
    return json.loads(path.read_text())


def _shard_bytes(split_dir: Path, shard: dict, problems: list[str]) -> bytes | None:
    """The shard's decompressed bytes after checking size and hashes, or None if it is unusable."""
    stored = shard["zip_data"] or shard["raw_data"]
    path = split_dir / stored["basename"]
    if not path.is_file():
        problems.append(f"{path}: missing shard")
        return None
    data = path.read_bytes()
    if len(data) != stored["bytes"]:
        problems.append(f"{path}: {len(data)} bytes, index says {stored['bytes']}")
        return None
    for algo, expected in stored["hashes"].items():
        if file_hash(algo, data) != expected:
            problems.append(f"{path}: {algo} hash mismatch (corrupt or altered shard)")
            return None
    return decompress_shard(shard["compression"], data) if shard["zip_data"] else data


def iter_split_samples(root: str | Path, split: str, problems: list[str]) -> Iterator[np.ndarray]:
    """Yield each shard's (samples, block_size + 1) token array in index order, recording problems."""
    root = Path(root)
    metadata = read_metadata(root)
    split_dir = root / split
    expected_encoding = column_encoding(metadata.np_dtype, metadata.block_size)
    for shard in _read_index(split_dir)["shards"]:
        name = shard["raw_data"]["basename"]
        if shard["column_names"] != [metadata.column] or shard["column_encodings"] != [expected_encoding]:
            problems.append(f"{split}/{name}: columns {shard['column_names']} {shard['column_encodings']}, "
                            f"expected [{metadata.column!r}] [{expected_encoding!r}]")
            continue
        data = _shard_bytes(split_dir, shard, problems)
        if data is None:
            continue
        try:
            samples = shard_samples(data, metadata.np_dtype, metadata.sample_length)
        except ValueError as err:
            problems.append(f"{split}/{name}: {err}")
            continue
        if len(samples) != shard["samples"]:
            problems.append(f"{split}/{name}: holds {len(samples)} samples, index says {shard['samples']}")
        yield samples


def verify_dataset(root: str | Path) -> VerifyReport:
    """Check every split; problems are collected, not raised, so one run lists them all."""
    metadata = read_metadata(root)
    report = VerifyReport(metadata)
    problems = report.problems
    for split, stats in metadata.splits.items():
        split_report = report.splits[split] = SplitReport()
        previous_last = None
        for samples in iter_split_samples(root, split, problems):
            split_report.shards += 1
            split_report.samples += len(samples)
            split_report.bytes += samples.nbytes
            if len(samples) == 0:
                continue
            if int(samples.max()) >= metadata.vocab_size:
                problems.append(f"{split}: token id {int(samples.max())} >= vocab_size {metadata.vocab_size}")
            # Consecutive samples share one token: the last of one is the first of the next.
            firsts = samples[:, 0]
            lasts = np.concatenate([[previous_last], samples[:-1, -1]]) if previous_last is not None \
                else samples[:-1, -1]
            checked = firsts if previous_last is not None else firsts[1:]
            bad = np.flatnonzero(checked != lasts)
            if len(bad):
                problems.append(f"{split}: sample {split_report.samples - len(samples) + int(bad[0])} "
                                "does not start with the previous sample's last token")
            previous_last = samples[-1, -1]
            split_report.eot_tokens += int(np.count_nonzero(samples[:, 1:] == metadata.eot_id))
        if split_report.samples != stats.samples:
            problems.append(f"{split}: {split_report.samples} samples in shards, metadata says {stats.samples}")
        if stats.samples and stats.samples * metadata.block_size + 1 + stats.dropped_tokens != stats.tokens:
            problems.append(f"{split}: samples, block size and dropped tokens do not add up to {stats.tokens} tokens")
        if split_report.eot_tokens > stats.documents:
            problems.append(f"{split}: {split_report.eot_tokens} end-of-text tokens but {stats.documents} documents")
    return report


def read_sample(root: str | Path, split: str, index: int) -> np.ndarray:
    """Sample `index` of a split, straight from the shards."""
    problems: list[str] = []
    seen = 0
    for samples in iter_split_samples(root, split, problems):
        if index < seen + len(samples):
            return samples[index - seen]
        seen += len(samples)
    if problems:
        raise UserError(problems[0])
    raise UserError(f"{split} has {seen} samples; sample {index} does not exist")
