"""A converted split as a Grain data source (`pip install tokstream[grain]`), for JAX and other loops that load
with Grain instead of torch's DataLoader.

Record i is sample i of the split: its block_size + 1 token ids (inputs tokens[:-1], targets tokens[1:]), the
very samples tokstream's reader gives. Shuffling, sharding over processes, batching and checkpointing are
Grain's own (its MapDataset or DataLoader with an IndexSampler); this is only the random access, through
format.py, with neither streaming nor torch imported. The dataset must be on local disk: Grain reads records
by index, one at a time, which an object store would turn into a request per sample.
"""

import bisect
import os
from pathlib import Path

import numpy as np

from tokstream.errors import UserError
from tokstream.format import (decompress_shard, index_shards, parse_column_encoding, read_metadata, shard_samples,
                              stored_file)
from tokstream.split_check import check_split, damaged_shard, dataset_identity, sample_count_problem


class TokenSampleSource:
    """grain.sources.RandomAccessDataSource over ROOT/SPLIT: len() samples, source[i] a read-only
    (block_size + 1,) array in the dataset's dtype. Picklable (Grain's worker processes each map the shards
    for themselves). Its repr names the split's identity (a digest of its metadata and index), which Grain's
    DataLoader checks when it restores a checkpoint: another dataset is refused rather than read in another
    order, and the same one copied to another path is accepted."""

    def __init__(self, root: str | os.PathLike, split: str = "train"):
        root = os.fspath(root).rstrip("/")
        if "://" in root:
            raise UserError(f"{root}: the Grain source reads a dataset on local disk; copy it there first "
                            f"(aws s3 sync {root} DIR) and give DIR")
        metadata = read_metadata(root)
        if split not in metadata.splits:
            raise UserError(f"{root} has no {split} split (it has {', '.join(metadata.splits)})")
        check_split(Path(root), split, metadata, root, local_files=True)
        shards = index_shards(Path(root, split))
        self.root, self.split = root, split
        self.identity = dataset_identity(Path(root), split)
        self.dtype, self.sample_length = parse_column_encoding(shards[0]["column_encodings"][0])
        self._files = [stored_file(shard)["basename"] for shard in shards]
        self._compression = [shard["compression"] if shard["zip_data"] else None for shard in shards]
        self._counts = [shard["samples"] for shard in shards]
        self._starts = np.cumsum([0] + self._counts).tolist()  # first sample of each shard; the total last
        self._views: dict[int, np.ndarray] = {}  # this process's mapped shards
        self._unpacked: tuple[int, np.ndarray] | None = None  # the compressed shard read last, decompressed

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, index: int) -> np.ndarray:
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} is outside {self!r}, which has {len(self)}")
        shard = bisect.bisect_right(self._starts, index) - 1
        return self._samples(shard)[index - self._starts[shard]]

    def _samples(self, shard: int) -> np.ndarray:
        """The shard's samples: mapped, or (compressed) decompressed into memory, one shard at a time; random
        access to a compressed split decompresses a shard per record, so convert for Grain uncompressed."""
        if self._compression[shard] is None:
            if shard not in self._views:
                mapped = np.asarray(np.memmap(self._path(shard), dtype=np.uint8, mode="r"))  # a plain view reads faster
                self._views[shard] = self._checked(shard, mapped)
            return self._views[shard]
        if self._unpacked is None or self._unpacked[0] != shard:
            data = decompress_shard(self._compression[shard], self._path(shard).read_bytes())
            self._unpacked = (shard, self._checked(shard, np.frombuffer(data, dtype=np.uint8)))
        return self._unpacked[1]

    def _checked(self, shard: int, data: np.ndarray) -> np.ndarray:
        try:
            samples = shard_samples(data, self.dtype, self.sample_length, every_offset=False)
            problem = sample_count_problem(len(samples), self._counts[shard])
        except ValueError as err:
            problem = str(err)
        if problem is not None:
            raise UserError(damaged_shard(self._path(shard), problem, self.root))
        return samples

    def _path(self, shard: int) -> Path:
        return Path(self.root, self.split, self._files[shard])

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_views": {}, "_unpacked": None}  # each process maps for itself

    def __repr__(self) -> str:  # the data, not where it lies: a checkpoint restores on a copy elsewhere
        return f"TokenSampleSource(split={self.split!r}, identity={self.identity!r}, samples={len(self)})"
