"""An epoch's order computed where it is read, for datasets in the lazy shuffle (data.shuffle_algo: feistel_window):
what a worker reads at any place of its part, in O(log shards) a sample after O(shards) set-up, with no array of
the epoch's size and nothing in shared memory.

Streaming's order is three arrays composed: the samples each stream gives the epoch (its resampling), their
shuffle, and the partition over nodes, ranks and workers. Here each is a function:

- the resampling: each stream's whole repeats, and for the part of a repeat its `choose` leaves, how many
  samples each shard gives (a multivariate hypergeometric draw: as many as drawing that many samples without
  replacement would give it, keyed by seed, epoch and stream) and which (the first of a keyed bijection of the
  shard). Streaming draws these one shard after another from one generator, which cannot be done for one shard
  alone: this is the project's own resampling, the lazy order's, not stock's;
- the shuffle: lazy_shuffle.WindowShuffle over the resampled units, as streaming shuffles them;
- the partition: lazy_partition, equal to streaming's own.
"""

import numpy as np

from tokstream.reader.lazy_partition import Partition, RelaxedPartition
from tokstream.reader.lazy_shuffle import WindowShuffle, _key, window_permutation


class LazyEpochOrder:
    """Position in the epoch's order -> sample id, for a dataset's shards (in its streams' order)."""

    def __init__(self, samples_per_shard: np.ndarray, shards_per_stream: list[int], chooses: list[int | None],
                 seed: int, epoch: int, num_canonical_nodes: int, block_size: int):
        samples_per_shard = np.asarray(samples_per_shard, np.int64)
        self.shard_offsets = np.concatenate([[0], np.cumsum(samples_per_shard)[:-1]]).astype(np.int64)
        self.seed, self.epoch = seed, epoch
        # Each shard of each stream gives `repeats` whole units, then one partial unit of `take` samples if any.
        units, unit_shards, partial = [], [], []
        first = 0
        for stream, count in enumerate(shards_per_stream):
            sizes = samples_per_shard[first:first + count]
            total = int(sizes.sum())
            choose = total if chooses[stream] is None else int(chooses[stream])
            repeats, rest = divmod(choose, total) if total else (0, 0)
            takes = np.zeros(count, np.int64)
            if rest:
                rng = np.random.default_rng([seed, epoch, stream])
                takes = rng.multivariate_hypergeometric(sizes, rest, method="marginals")
            per_shard = np.where(sizes > 0, repeats + (takes > 0), 0)  # an empty shard gives nothing
            shard = np.repeat(np.arange(count), per_shard)
            nth = np.arange(len(shard)) - np.repeat(np.cumsum(per_shard) - per_shard, per_shard)  # within its shard
            units.append(np.where(nth < repeats, sizes[shard], takes[shard]))
            unit_shards.append(shard + first)
            partial.append(nth >= repeats)
            first += count
        self.units = np.concatenate(units).astype(np.int64)
        self.unit_starts = np.concatenate([[0], np.cumsum(self.units)]).astype(np.int64)
        self.unit_shards = np.concatenate(unit_shards).astype(np.int64)
        self.partial = np.concatenate(partial).astype(bool)
        self.samples_per_shard = samples_per_shard
        self.epoch_size = int(self.unit_starts[-1])
        self.shuffle = WindowShuffle(tuple(self.units.tolist()), num_canonical_nodes, seed, epoch, block_size)

    def at(self, positions: np.ndarray) -> np.ndarray:
        """The sample at each position (0 <= position < epoch_size) of the epoch's order."""
        resampled = self.shuffle.at(positions)
        unit = np.searchsorted(self.unit_starts, resampled, side="right") - 1
        within = resampled - self.unit_starts[unit]
        shard = self.unit_shards[unit]
        picked = self.partial[unit]
        if picked.any():  # a shard's part of a repeat: its first `take` under the shard's keyed bijection
            keys = _key(self.seed, self.epoch, shard[picked], 1 << 40)
            within[picked] = window_permutation(within[picked], self.samples_per_shard[shard[picked]], keys).astype(
                np.int64)
        return self.shard_offsets[shard] + within


class LazyWorkerIds:
    """A worker's part of an epoch from sample_in_epoch on, as streaming hands a worker its work (its sample ids, -1
    where streaming pads), each slice computed when asked for: `len()` and `[start:stop]` are all that the door's
    download-ahead threads and yield loop use."""

    def __init__(self, order: LazyEpochOrder, partition: Partition | RelaxedPartition, node: int, rank: int,
                 worker: int):
        self.order, self.partition = order, partition
        self.node, self.rank, self.worker = node, rank, worker
        shape = partition.shape
        self.length = shape[3] * shape[4]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("a lazy worker's ids are read a range at a time")
        start, stop, _ = key.indices(self.length)
        positions = self.partition.ids(self.node, self.rank, self.worker, np.arange(start, max(start, stop)))
        ids = np.full(positions.shape, -1, np.int64)
        read = positions >= 0
        ids[read] = self.order.at(positions[read])
        return ids


def lazy_partition(algo: str, epoch_size: int, num_canonical_nodes: int, nodes: int, ranks_per_node: int,
                   workers_per_rank: int, batch_size: int, sample_in_epoch: int,
                   initial_physical_nodes: int | None) -> Partition | RelaxedPartition:
    """Streaming's partition `algo` (orig or relaxed) in closed form."""
    if algo == "orig":
        return Partition(epoch_size, num_canonical_nodes, nodes, ranks_per_node, workers_per_rank, batch_size,
                         sample_in_epoch)
    if algo == "relaxed":
        return RelaxedPartition(epoch_size, num_canonical_nodes, nodes, ranks_per_node, workers_per_rank, batch_size,
                                sample_in_epoch, initial_physical_nodes)
    raise ValueError(f"the lazy order takes streaming's orig or relaxed partition, not {algo!r}")
