"""The fast reader: where training batches are produced.

`TokenDataset` yields whole batches: streaming's yield loop hands over the ids of a micro-batch (or,
in a DataLoader worker, of a transfer of several: token_loader.py) at once, and `get_batch` reads
them as (block_size + 1)-token rows of memory-mapped shards, stacked once into the batch's own
array. Which ids a rank asks for, in which order, and when shards are downloaded or evicted stay
stock streaming's (StreamingDataset's partitioning, shuffle, resume state and cache); the private
parts of streaming this relies on are behind one door, streaming_door/, switched on by its install().
"""

import os
import weakref

import numpy as np
import torch
from torch.utils.data import get_worker_info

from tokstream.errors import DamagedData
from tokstream.gc_pause import collector_paused
from tokstream.format import parse_column_encoding, shard_sample_count, shard_samples
from tokstream.reader import streaming_door
from tokstream.reader.notices import start_resource_tracker
from tokstream.reader.streaming_door import streaming_internals as internals
from tokstream.reader.stale_shm import record_owner, release_owner
from tokstream.reader.transfer_ring import TransferRing
from tokstream.split_check import damaged_shard, sample_count_problem, vocabulary_problem

_TORCH_DTYPE = {np.dtype(np.uint16): torch.uint16, np.dtype(np.uint32): torch.uint32}


class TokenDataset(internals.ResumeStateKept, internals.WindowedDownloadAhead):
    """Stock StreamingDataset that yields batches of this format's fixed-size token samples.

    Stock `get_item` opens, seeks and reads the shard file and parses the column encodings for
    every sample, and a DataLoader asks for samples one Python call chain at a time. Here each local
    shard is memory-mapped once (per process) and a batch is its samples' rows stacked into one
    array: in the rank, a tensor in pinned memory when `pin_batches` is set (the one copy on the
    way to the GPU). A shard that is not local in streaming's shared state (not downloaded yet,
    being downloaded, or evicted) goes through stock `get_item`, which fetches it, and is mapped
    afresh afterwards; a mapping is dropped the moment its shard stops being local, so an evicted
    file is never read and its disk space is really freed.
    """

    def __init__(self, *args, vocab_sizes: list[int] | None = None, **kwargs):
        """`vocab_sizes`: per stream, the bound on its token ids (its metadata's vocab_size, which training
        has checked is at most the model's): every sample is checked against it as it is read."""
        streaming_door.install()  # before the stock constructor: it builds the lookup and shared memory
        start_resource_tracker()  # before the stock constructor registers its shared memory with it
        with collector_paused():  # a reader object per shard: tens of thousands (gc_pause.py)
            super().__init__(*args, **kwargs)
        self.vocab_sizes = vocab_sizes
        self.pin_batches = False  # set by TokenLoader
        self.transfer_samples: int | None = None  # samples per item in a DataLoader worker (TokenLoader)
        self.ring: TransferRing | None = None  # where workers write their transfers, if shared (TokenLoader)
        self._views: dict[int, np.ndarray] = {}  # shard id -> (samples, tokens) view of its mapped file
        self._sample_format: tuple[np.dtype, int] | None = None
        # Lets a relaunch tell this prefix's shared memory from a killed run's (stale_shm.py). Released when
        # the dataset goes, or at exit before modules are torn down (a __del__ then could not unlink).
        self._release_owner = weakref.finalize(self, release_owner, record_owner(internals.shm_prefix(self)),
                                               os.getpid())
        # Its shared memory: stock keeps it until exit (streaming_internals.release_shared_memory).
        self._owner_pid = os.getpid()
        self._release_blocks = weakref.finalize(self, internals.release_shared_memory,
                                                internals.shared_memory_blocks(self), self._owner_pid)

    def release_shared_memory(self) -> None:
        """Give up its shared memory now (TrainBatches.close): nothing can be read from it afterwards."""
        internals.release_shared_memory(internals.shared_memory_blocks(self), self._owner_pid)
        self._release_blocks()
        self._release_owner()

    def samples_per_item(self) -> int:
        in_worker = get_worker_info() is not None
        return self.transfer_samples if in_worker and self.transfer_samples else self.batch_size

    def __getitem__(self, at):
        if isinstance(at, list):  # a batch's ids, from the door's yield loop (WindowedDownloadAhead)
            return self.get_batch(at)
        return super().__getitem__(at)

    def prepare_shard(self, shard_id: int, blocking: bool = True) -> None:
        """The fence's, with streaming's bare "Checksum failure" (validate_hash) said as a damaged shard."""
        try:
            return super().prepare_shard(shard_id, blocking)
        except ValueError as err:
            if not str(err).startswith("Checksum failure"):
                raise
            stream = self.streams[self.stream_per_shard[shard_id]]
            basename = os.path.basename(internals.shard_file(self, shard_id))
            name = f"{stream.remote}/{self.shards[shard_id].split}/{basename}"
            raise DamagedData(damaged_shard(name, f"does not match its {stream.validate_hash} hash in index.json "
                                            "once downloaded", stream.remote)) from None

    def _map_shard(self, shard_id: int) -> np.ndarray:
        dtype, length = self.sample_format()
        path = internals.shard_file(self, shard_id)
        # A plain ndarray view: slicing a np.memmap subclass costs far more per sample.
        mapped = np.asarray(np.memmap(path, dtype=np.uint8, mode="r"))
        view = shard_samples(mapped, dtype, length, every_offset=False)
        self._check(shard_id, path, sample_count_problem(len(view), self.shards[shard_id].samples))
        return view

    def _check(self, shard_id: int, path: object, problem: str | None = None, largest: int | None = None) -> None:
        """Refuse a shard read with a `problem`, or whose `largest` token id is past its stream's vocabulary,
        which would end training in an embedding lookup (a device assert on a GPU). Run once per mapped shard,
        and for each batch read (_check_vocabulary)."""
        stream = self.stream_per_shard[shard_id]
        if problem is None and largest is not None:
            problem = vocabulary_problem(largest, self.vocab_sizes[stream])
        if problem is not None:
            dataset = self.streams[stream].remote or self.streams[stream].local
            raise DamagedData(damaged_shard(path, problem, dataset))

    def sample_format(self) -> tuple[np.dtype, int]:
        if self._sample_format is None:
            self._sample_format = parse_column_encoding(internals.first_column_encoding(self))
        return self._sample_format

    def release_evicted(self) -> None:
        """Drop the mappings of shards that are no longer local, so an evicted file's disk space is
        freed. Run whenever another shard is mapped (evictions make room for new shards, so this
        catches them within one shard, not at the evicted shard's next read, maybe never) and by a
        download-ahead thread that evicted for a disk's room. A batch being read keeps its own
        reference to a view until it is stacked."""
        for shard_id in [s for s in list(self._views) if not internals.shard_is_local(self, s)]:
            self._views.pop(shard_id, None)

    def _local_view(self, shard_id: int) -> np.ndarray | None:
        """The mapped shard, or None if it is not local (stock get_item then fetches it)."""
        view = self._views.get(shard_id)
        if view is None:
            self.release_evicted()
            try:
                view = self._views[shard_id] = self._map_shard(shard_id)
            except FileNotFoundError:  # evicted by another rank between the state check and here
                return None
        internals.mark_shard_used(self, shard_id)
        return view

    def _rows(self, sample_ids: np.ndarray) -> list[np.ndarray]:
        shards, indices = internals.shard_of_samples(self, sample_ids)
        local = dict(zip(shards.tolist(), internals.shards_are_local(self, shards).tolist()))
        views = {}
        for shard_id, is_local in local.items():
            if not is_local:
                self._views.pop(shard_id, None)
            views[shard_id] = self._local_view(shard_id) if is_local else None
        rows = []
        for sample_id, shard_id, index in zip(sample_ids.tolist(), shards.tolist(), indices.tolist()):
            view = views[shard_id]
            if view is not None:
                rows.append(view[index])
            else:
                rows.append(super().get_item(sample_id)["tokens"])
                path = internals.shard_file(self, shard_id)
                # Once fetched, its header must count the index's samples, as a mapped shard's does (_map_shard):
                # a rank that read it this way, while another prepared it, refuses it as that rank does.
                try:
                    problem = sample_count_problem(shard_sample_count(path), self.shards[shard_id].samples)
                except FileNotFoundError:  # evicted already (a cache_limit): checked when it is mapped
                    problem = None
                self._check(shard_id, path, problem)
        return rows

    def _check_vocabulary(self, ids: np.ndarray, tokens: np.ndarray) -> None:
        """Refuse stacked (samples, tokens) holding a token id past its stream's vocabulary, naming the first such
        sample's shard. Every token counts (the last is a target) and only the samples read: a scan of each shard
        at its first read cost every rank and worker 64 MB a shard at start-up. One max over the batch; the rows
        are looked at one by one only when it is past the smallest vocabulary."""
        if self.vocab_sizes is None or not tokens.size or int(tokens.max()) < min(self.vocab_sizes):
            return
        largest = tokens.max(axis=1).astype(np.int64)
        shards, _ = internals.shard_of_samples(self, ids)
        over = np.flatnonzero(largest >= np.asarray(self.vocab_sizes)[self.stream_per_shard[shards]])
        if len(over):
            shard_id = int(shards[over[0]])
            self._check(shard_id, internals.shard_file(self, shard_id), largest=int(largest[over[0]]))

    def get_batch(self, sample_ids: list[int]) -> dict:
        """The samples' tokens as one (samples, block_size + 1) array, and their ids.

        In the rank: tensors, the tokens pinned if `pin_batches`. In a DataLoader worker: numpy arrays
        shaped as whole micro-batches, with the worker's id (they cross to the rank in one pickle), or,
        with a ring, the tokens written into the worker's next slot and only the slot's number sent.
        """
        ids = np.array(sample_ids, dtype=np.int64)
        worker = get_worker_info()
        if worker is not None and self.ring is not None:
            transfer = self.ring.write(worker.id, self._rows(ids),
                                       check=lambda tokens: self._check_vocabulary(ids, tokens))
            if transfer is None:  # the rank closed the ring: it reads no more
                os._exit(0)
            return {"worker": worker.id, "transfer": transfer, "ids": ids.reshape(-1, self.batch_size)}
        if worker is not None:
            tokens = np.stack(self._rows(ids))
            self._check_vocabulary(ids, tokens)
            return {"worker": worker.id, "tokens": tokens.reshape(-1, self.batch_size, tokens.shape[1]),
                    "ids": ids.reshape(-1, self.batch_size)}
        dtype, length = self.sample_format()
        tokens = torch.empty((len(ids), length), dtype=_TORCH_DTYPE[dtype], pin_memory=self.pin_batches)
        np.stack(self._rows(ids), out=tokens.numpy())
        self._check_vocabulary(ids, tokens.numpy())
        return {"tokens": tokens, "ids": torch.from_numpy(ids)}

    def get_item(self, sample_id: int) -> dict:
        """One sample (dataset[i]): a view of its mapped shard."""
        row = self._rows(np.array([sample_id]))[0]
        self._check_vocabulary(np.array([sample_id]), row[None])
        return {"tokens": row, "id": sample_id}
