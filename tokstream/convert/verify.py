"""Checking a dataset against its index, its hashes and this project's format rules."""

import json
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tokstream.errors import UserError
from tokstream.format import (METADATA_FILE, DatasetMetadata, column_encoding, decompress_shard, file_hash,
                              shard_samples, stored_file)
from tokstream.object_store import S3Dataset, is_s3
from tokstream.tokenizer import dataset_tokenizer, identity_contradiction


@dataclass
class SplitReport:
    shards: int = 0
    samples: int = 0
    bytes: int = 0
    separator_tokens: int = 0  # document separators among the split's distinct stream positions


@dataclass
class VerifyReport:
    metadata: DatasetMetadata
    splits: dict[str, SplitReport] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


class DatasetFiles:
    """A dataset's files by relative path: local ones in place, S3 ones fetched one at a time."""

    def __init__(self, root: str | Path):
        self.root = str(root).rstrip("/")
        self.store = S3Dataset(self.root) if is_s3(self.root) else None
        self.scratch = Path(tempfile.mkdtemp(prefix="tokstream-verify-")) if self.store else None

    def read(self, relative: str) -> bytes | None:
        """The file's bytes, or None if it does not exist."""
        if self.store is None:
            path = Path(self.root, relative)
            return path.read_bytes() if path.is_file() else None
        if not self.store.exists(relative):
            return None
        path = self.store.download(relative, self.scratch / relative)
        try:
            return path.read_bytes()
        finally:
            path.unlink()  # S3 datasets are checked with one shard on local disk at a time

    def metadata(self) -> DatasetMetadata:
        text = self.read(METADATA_FILE)
        if text is None:
            raise UserError(f"{self.root} has no {METADATA_FILE}: not a dataset written by this project's "
                            "converters, or its conversion has not finished")
        return DatasetMetadata.from_json(text.decode(), where=f"{self.root}/{METADATA_FILE}")

    def close(self) -> None:
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)


def _read_index(files: DatasetFiles, split: str) -> dict:
    data = files.read(f"{split}/index.json")
    if data is None:
        raise UserError(f"{files.root}/{split}/index.json is missing: the split was never finished")
    return json.loads(data)


def _shard_bytes(files: DatasetFiles, split: str, shard: dict, problems: list[str]) -> bytes | None:
    """The shard's decompressed bytes after checking size and hashes, or None if it is unusable."""
    stored = stored_file(shard)
    path = f"{files.root}/{split}/{stored['basename']}"
    data = files.read(f"{split}/{stored['basename']}")
    if data is None:
        problems.append(f"{path}: missing shard")
        return None
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
    files = DatasetFiles(root)
    try:
        yield from _split_samples(files, split, problems)
    finally:
        files.close()


def _split_samples(files: DatasetFiles, split: str, problems: list[str]) -> Iterator[np.ndarray]:
    metadata = files.metadata()
    expected_encoding = column_encoding(metadata.np_dtype, metadata.block_size)
    for shard in _read_index(files, split)["shards"]:
        name = shard["raw_data"]["basename"]
        if shard["column_names"] != [metadata.column] or shard["column_encodings"] != [expected_encoding]:
            problems.append(f"{split}/{name}: columns {shard['column_names']} {shard['column_encodings']}, "
                            f"expected [{metadata.column!r}] [{expected_encoding!r}]")
            continue
        data = _shard_bytes(files, split, shard, problems)
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
    files = DatasetFiles(root)
    try:
        metadata = files.metadata()
    finally:
        files.close()
    contradiction = identity_contradiction(metadata.tokenizer, metadata.tokenizer_sha256)
    if contradiction:
        raise UserError(f"{files.root}/{METADATA_FILE} contradicts itself: {contradiction}; it was edited or damaged: "
                        "restore it from the conversion, or reconvert")
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
            split_report.separator_tokens += int(np.count_nonzero(samples[:, 1:] == metadata.separator_id))
        if split_report.samples != stats.samples:
            problems.append(f"{split}: {split_report.samples} samples in shards, metadata says {stats.samples}")
        if stats.samples and stats.samples * metadata.block_size + 1 + stats.dropped_tokens != stats.tokens:
            problems.append(f"{split}: samples, block size and dropped tokens do not add up to {stats.tokens} tokens")
        if split_report.separator_tokens > stats.documents:
            problems.append(f"{split}: {split_report.separator_tokens} separator tokens but {stats.documents} "
                            "documents")
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


def decode_sample(root: str | Path, split: str, index: int, metadata: DatasetMetadata, tokenizer: str | None = None,
                  ranks_file: str | None = None) -> tuple[np.ndarray, str]:
    """Sample `index` of the split, and its text in the tokenizer the dataset was converted with (or `tokenizer`)."""
    tokens = read_sample(root, split, index)
    return tokens, dataset_tokenizer(metadata, str(root), tokenizer, ranks_file).decode(tokens.tolist())
