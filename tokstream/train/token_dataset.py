"""The fast reader: where a training sample is produced.

`TokenDataset.get_item(sample_id)` returns one sample, a (block_size + 1) uint16/uint32 view of
a memory-mapped shard, plus its global id. Which ids a rank asks for, in which order, and when
shards are downloaded or evicted stay stock streaming's (StreamingDataset's partitioning,
shuffle, resume state and cache); the private parts of streaming this relies on are fenced in
streaming_internals.py.
"""

import os

import numpy as np

from tokstream.format import parse_column_encoding, shard_samples
from tokstream.train import streaming_internals as internals
from tokstream.train.stale_shm import record_owner, release_owner


class TokenDataset(internals.WindowedDownloadAhead):
    """Stock StreamingDataset with a per-sample path for this format's fixed-size token samples.

    Stock `get_item` opens, seeks and reads the shard file and parses the column encodings for
    every sample. Here each local shard is memory-mapped once (per process) and a sample is a
    slice of it, no copy. A shard that is not local in streaming's shared state (not downloaded
    yet, being downloaded, or evicted) goes through stock `get_item`, which fetches it, and is
    mapped afresh afterwards; a mapping is dropped the moment its shard stops being local, so an
    evicted file is never read and its disk space is really freed.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._views: dict[int, np.ndarray] = {}  # shard id -> (samples, tokens) view of its mapped file
        self._sample_format: tuple[np.dtype, int] | None = None
        # Lets a relaunch tell this prefix's shared memory from a killed run's (stale_shm.py).
        self._owner_pid, self._owner_record = os.getpid(), record_owner(internals.shm_prefix(self))

    def __del__(self) -> None:
        if getattr(self, "_owner_pid", None) == os.getpid():  # not in a DataLoader worker's copy
            release_owner(self._owner_record)
        super().__del__()

    def _map_shard(self, shard_id: int) -> np.ndarray:
        if self._sample_format is None:
            self._sample_format = parse_column_encoding(internals.first_column_encoding(self))
        dtype, length = self._sample_format
        path = internals.shard_file(self, shard_id)
        # A plain ndarray view: slicing a np.memmap subclass costs far more per sample.
        return shard_samples(np.asarray(np.memmap(path, dtype=np.uint8, mode="r")), dtype, length)

    def _stock_item(self, sample_id: int) -> dict:
        """Stock streaming's read, which also fetches a shard that is not local."""
        return {"tokens": super().get_item(sample_id)["tokens"], "id": sample_id}

    def _unmap_evicted(self) -> None:
        """Drop the mappings of shards that are no longer local, so an evicted file's disk space is
        freed. Run whenever another shard is mapped: evictions make room for new shards, so this
        catches them within one shard, not at the evicted shard's next read (maybe never)."""
        for shard_id in [s for s in self._views if not internals.shard_is_local(self, s)]:
            del self._views[shard_id]

    def get_item(self, sample_id: int) -> dict:
        shard_id, index = self.spanner[sample_id]
        if not internals.shard_is_local(self, shard_id):
            self._views.pop(shard_id, None)
            return self._stock_item(sample_id)
        view = self._views.get(shard_id)
        if view is None:
            self._unmap_evicted()
            try:
                view = self._views[shard_id] = self._map_shard(shard_id)
            except FileNotFoundError:  # evicted by another rank between the state check and here
                return self._stock_item(sample_id)
        internals.mark_shard_used(self, shard_id)
        return {"tokens": view[index], "id": sample_id}
