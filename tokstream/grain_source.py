"""Used by JAX and other loops that load with Grain: a converted split as a Grain data source (`pip install -e
'.[grain]'`). It lives at the package root, apart from the reader's modules: most import streaming, which this
must not.

Record i is sample i of the split: its block_size + 1 token ids (inputs tokens[:-1], targets tokens[1:]), the
very samples tokstream's reader gives. Shuffling, sharding over processes, batching and checkpointing are
Grain's own (its MapDataset or DataLoader with an IndexSampler); this is only the random access, through
format.py, with neither streaming nor torch imported. The dataset must be on local disk: Grain reads records
by index, one at a time, which an object store would turn into a request per sample.
"""

import bisect
import operator
import os
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

from tokstream.errors import UserError
from tokstream.format import (decompress_shard, index_shards, parse_column_encoding, read_metadata, shard_samples,
                              stored_file)
from tokstream.split_check import (check_split, damaged_shard, former_dataset_identity, largest_token,
                                   sample_count_problem, vocabulary_problem)


class TokenSampleSource:
    """grain.sources.RandomAccessDataSource over ROOT/SPLIT: len() samples, source[i] a read-only
    (block_size + 1,) array in the dataset's dtype. Picklable (Grain's worker processes each map the shards
    for themselves). Its repr names the split's identity (a digest of its metadata and index), which Grain's
    DataLoader checks when it restores a checkpoint: another dataset is refused rather than read in another
    order, and the same one copied to another path is accepted."""

    # Shards mapped at once per process (each mapping holds a file descriptor): a split of more shards than
    # the descriptor limit reads through, mapping again the ones it dropped (a mapping costs microseconds).
    max_mapped_shards = 64

    def __init__(self, root: str | os.PathLike, split: str = "train"):
        root = os.fspath(root).rstrip("/")
        if "://" in root:
            raise UserError(f"{root}: the Grain source reads a dataset on local disk; copy it there first (for S3: "
                            "aws s3 sync URL DIR) and give DIR")
        metadata = read_metadata(root)
        if split not in metadata.splits:
            raise UserError(f"{root} has no {split} split (it has {', '.join(metadata.splits)})")
        check_split(Path(root), split, metadata, root, local_files=True)
        shards = index_shards(Path(root, split))
        self.root, self.split = root, split
        self.vocab_size = metadata.vocab_size
        # The former identity (metadata.json whole): Grain compares reprs, so the digest that DataLoader checkpoints
        # made before 2026-11-28 hold stays the one here (a split added to the dataset changes it).
        self.identity = former_dataset_identity(Path(root), split)
        try:
            self.dtype, self.sample_length = parse_column_encoding(shards[0]["column_encodings"][0])
            self._files = [stored_file(shard)["basename"] for shard in shards]
            self._compression = [shard["compression"] if shard["zip_data"] else None for shard in shards]
        except (KeyError, TypeError, ValueError, IndexError) as err:
            raise UserError(f"{root}/{split}/index.json is damaged ({type(err).__name__}: {err}); reconvert the "
                            "split") from None
        self._counts = [shard["samples"] for shard in shards]
        self._starts = np.cumsum([0] + self._counts).tolist()  # first sample of each shard; the total last
        # This process's mapped shards, the most recently read last: each mapping holds a file descriptor.
        self._views: OrderedDict[int, np.ndarray] = OrderedDict()
        self._sample_ends: dict[int, int] = {}  # per shard mapped: the file's length its samples need
        self._unpacked: tuple[int, np.ndarray] | None = None  # the compressed shard read last, decompressed
        self._mapping_lock = threading.Lock()

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, index: int) -> np.ndarray:
        index = operator.index(index)  # an int or numpy integer; a float is a caller's bug, not sample int(x)
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} is outside {self!r}, which has {len(self)}")
        shard = bisect.bisect_right(self._starts, index) - 1
        samples = self._samples(shard)
        if self._compression[shard] is None:
            self._check_length(shard)
        return samples[index - self._starts[shard]]

    def _check_length(self, shard: int) -> None:
        """A shard truncated since it was mapped would read as zeros (its last page) or kill the process (SIGBUS,
        past it): a stat before each read refuses it instead."""
        end = self._sample_ends[shard]
        try:
            size = os.stat(self._path(shard)).st_size
        except FileNotFoundError:
            size = -1
        if size < end:
            raise UserError(damaged_shard(self._path(shard), f"is {max(size, 0)} bytes since it was opened, not the "
                                          f"{end} its samples need (truncated or removed while read)", self.root))

    def _samples(self, shard: int) -> np.ndarray:
        """The shard's samples: mapped, or (compressed) decompressed into memory, one shard at a time; random
        access to a compressed split decompresses a shard per record, so convert for Grain uncompressed."""
        if self._compression[shard] is None:
            with self._mapping_lock:  # Grain may read from several threads
                view = self._views.get(shard)
                if view is None:
                    mapped = np.asarray(np.memmap(self._path(shard), dtype=np.uint8, mode="r"))  # a plain view reads faster
                    view = self._views[shard] = self._checked(shard, mapped, mapped=True)
                    self._sample_ends[shard] = view.ctypes.data - mapped.ctypes.data + view.nbytes
                    while len(self._views) > self.max_mapped_shards:
                        self._views.popitem(last=False)  # records handed out keep their own mapping alive
                else:
                    self._views.move_to_end(shard)
                return view
        unpacked = self._unpacked  # one read: Grain may call from several threads, each replacing it
        if unpacked is None or unpacked[0] != shard:
            try:
                data = decompress_shard(self._compression[shard], self._path(shard).read_bytes())
            except UserError:
                raise
            except Exception as err:  # zstd's own error type
                raise UserError(damaged_shard(self._path(shard), f"does not decompress ({err})", self.root)) from None
            unpacked = self._unpacked = (shard, self._checked(shard, np.frombuffer(data, dtype=np.uint8)))
        return unpacked[1]

    def _checked(self, shard: int, data: np.ndarray, mapped: bool = False) -> np.ndarray:
        """The shard's samples, refused (as the training reader refuses them) when their count is not the index's or
        a token id is past the vocabulary. A mapped shard is read for the check through a buffer (largest_token)."""
        try:
            samples = shard_samples(data, self.dtype, self.sample_length, every_offset=False)
            problem = sample_count_problem(len(samples), self._counts[shard])
        except ValueError as err:
            problem = str(err).removeprefix("shard ")  # "shard is truncated: ...", and damaged_shard names the shard
        if problem is None and len(samples):
            begin = samples.ctypes.data - data.ctypes.data
            largest = (largest_token(self._path(shard), begin, begin + samples.nbytes, self.dtype) if mapped
                       else int(samples.max()))
            problem = vocabulary_problem(largest, self.vocab_size)
        if problem is not None:
            raise UserError(damaged_shard(self._path(shard), problem, self.root))
        return samples

    def _path(self, shard: int) -> Path:
        return Path(self.root, self.split, self._files[shard])

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for name in ("_views", "_sample_ends", "_unpacked", "_mapping_lock"):  # each process maps for itself
            del state[name]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._views, self._sample_ends, self._unpacked = OrderedDict(), {}, None
        self._mapping_lock = threading.Lock()

    def __repr__(self) -> str:  # the data, not where it lies: a checkpoint restores on a copy elsewhere
        return f"TokenSampleSource(split={self.split!r}, identity={self.identity!r}, samples={len(self)})"
