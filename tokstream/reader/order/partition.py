"""Streaming's `orig` partition of an epoch over nodes, ranks and workers, in closed form: any sample's place in
O(1), where stock `get_partitions` builds an array of the whole epoch (8 bytes per sample) to read a rank's part.

Stock's steps, and the formula each one is here (N samples, C canonical and P physical nodes, R ranks per node,
W workers per rank, batch B, D samples dropped, rounded down to a multiple of P):

1. Canonical rows: row c holds samples [c*N//C, (c+1)*N//C), S = ceil(N/C) columns, the last one of a short
   row repeating its last sample; with C < P each row is padded to a multiple of P/C by repeating earlier
   columns (`canonical`). With fewer samples than canonical nodes, the rows tile 0..N-1 instead.
2. Read column by column (i = j*C + c), the first D dropped, dealt to the nodes in turn: node p's m-th
   sample is position m*P + p + D (`node_sample`).
3. A node's samples dealt to its ranks in turn, padded to a multiple of R with samples from its end
   (`rank_sample`); a rank's samples dealt to its workers a batch at a time, padded with -1 (`ids`).

`Partition(...).ids(node, rank, worker, positions)` is exactly stock's `get_partitions("orig", ...)[node, rank,
worker].reshape(-1)[positions]`; tests/test_lazy_partition.py proves it on thousands of configurations.
"""

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Partition:
    num_samples: int
    num_canonical_nodes: int
    num_physical_nodes: int
    ranks_per_node: int
    workers_per_rank: int
    batch_size: int
    drop_first: int = 0
    # Derived in __post_init__, each in O(1):
    columns: int = field(init=False)  # S: samples per canonical row before padding
    node_ratio: int = field(init=False)  # P / C when there are more physical nodes than canonical ones, else 0
    padding: int = field(init=False)  # columns added to each row so that it divides over node_ratio
    padding_source: int | None = field(init=False)  # the first column the padding repeats (None: column 0 for all)
    per_node: int = field(init=False)  # M: samples each node gets before its ranks' padding
    rank_padding: int = field(init=False)  # samples added to a node so that it divides over its ranks
    per_rank: int = field(init=False)  # Q: samples each rank gets
    batches_per_worker: int = field(init=False)

    def __post_init__(self) -> None:
        n, c, p, r = self.num_samples, self.num_canonical_nodes, self.num_physical_nodes, self.ranks_per_node
        w, b = self.workers_per_rank, self.batch_size
        world = r * p
        if n + world - n % world < self.drop_first:  # stock's words and checks, in stock's order
            raise ValueError(f"Resuming further into the dataset ({self.drop_first}) than it has samples ({n})")
        if (c < p and p % c) or (p < c and c % p):
            raise ValueError("Either canonical or physical nodes must be evenly divisible by the other")
        drop = self.drop_first - self.drop_first % p
        columns = (n + c - 1) // c
        node_ratio = p // c if c < p else 0
        padding = (node_ratio - columns % node_ratio) % node_ratio if node_ratio else 0
        source: int | None = columns - padding - node_ratio + 1
        few_samples = not (n > c or (n == c and c >= p))  # the rows then tile the samples, with no padding to copy
        if padding and source < 0 and not few_samples:
            # Stock's slice of the columns to repeat starts before the first: numpy clips it, and only a slice of
            # one column broadcasts over the padding.
            if columns - node_ratio + 1 != 1:
                raise ValueError(f"could not broadcast the {c} canonical rows' padding (stock fails here too)")
            source = None
        per_node = max(0, c * (columns + padding) - drop) // p
        overflow = per_node % r
        rank_padding = r - overflow if overflow else 0
        per_rank = (per_node + rank_padding) // r
        for name, value in (("drop_first", drop), ("columns", columns), ("node_ratio", node_ratio),
                            ("padding", padding), ("padding_source", source), ("per_node", per_node),
                            ("rank_padding", rank_padding), ("per_rank", per_rank),
                            ("batches_per_worker", math.ceil(per_rank / (w * b)))):
            object.__setattr__(self, name, value)

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """Stock's: (physical nodes, ranks per node, workers per rank, batches per worker, batch size)."""
        return (self.num_physical_nodes, self.ranks_per_node, self.workers_per_rank, self.batches_per_worker,
                self.batch_size)

    @property
    def _few_samples(self) -> bool:
        """Fewer samples than canonical nodes (or as many, with more physical nodes): the rows tile 0..N-1."""
        n, c = self.num_samples, self.num_canonical_nodes
        return not (n > c or (n == c and c >= self.num_physical_nodes))

    def canonical(self, row: np.ndarray, column: np.ndarray) -> np.ndarray:
        """The sample at (row, column) of the canonical rows (step 1)."""
        n, c, columns = self.num_samples, self.num_canonical_nodes, self.columns
        if self._few_samples:
            return (row * (columns + self.padding) + column) % n
        column = np.asarray(column, np.int64)
        if self.padding:  # a padding column repeats an earlier one
            repeated = column >= columns
            source = 0 if self.padding_source is None else self.padding_source + column - columns
            column = np.where(repeated, source, column)
        start = row * n // c
        short = ((row + 1) * n // c - start) < columns
        return start + column - ((column == columns - 1) & short)

    def node_sample(self, node: int, index: np.ndarray) -> np.ndarray:
        """The node's index-th sample before its ranks' padding (step 2)."""
        position = index * self.num_physical_nodes + node + self.drop_first
        column, row = np.divmod(position, self.num_canonical_nodes)
        return self.canonical(row, column)

    def rank_sample(self, node: int, rank: int, index: np.ndarray) -> np.ndarray:
        """The rank's index-th sample (step 3): the node's samples dealt to its ranks, its padding repeating its end
        (or, for a node of fewer samples than its padding needs, its samples again from the first)."""
        at = index * self.ranks_per_node + rank
        per_node, ranks = self.per_node, self.ranks_per_node
        if self.rank_padding:
            beyond = at - per_node
            enough = ranks + self.rank_padding - 1 <= per_node
            padded = per_node - ranks - self.rank_padding + 1 + beyond if enough else beyond % per_node
            at = np.where(beyond >= 0, padded, at)
        return self.node_sample(node, at)

    def ids(self, node: int, rank: int, worker: int, positions: np.ndarray | None = None) -> np.ndarray:
        """What stock's partition holds at [node, rank, worker] (batches x batch, flattened), at `positions` (all of
        them by default); -1 where stock pads."""
        b, w = self.batch_size, self.workers_per_rank
        if positions is None:
            positions = np.arange(self.batches_per_worker * b, dtype=np.int64)
        batch, within = np.divmod(np.asarray(positions, np.int64), b)
        index = batch * w * b + worker * b + within  # the worker's batches, dealt from the rank's samples in turn
        read = index < self.per_rank
        out = np.full(index.shape, -1, np.int64)
        out[read] = self.rank_sample(node, rank, index[read])
        return out

    def full(self) -> np.ndarray:
        """Every node, rank and worker's ids: stock's array, for tests (O(samples), as stock is)."""
        return full_array(self)


@dataclass(frozen=True)
class RelaxedPartition:
    """Streaming's `relaxed` partition: where the nodes no longer divide the canonical nodes, the `orig` partition of
    the launch's initial nodes (at the same global batch) read batch by batch and dealt to today's nodes; `orig`
    itself otherwise. A sample's place is still O(1)."""

    num_samples: int
    num_canonical_nodes: int
    num_physical_nodes: int
    ranks_per_node: int
    workers_per_rank: int
    batch_size: int
    drop_first: int = 0
    initial_physical_nodes: int | None = None
    initial: Partition = field(init=False)  # the orig partition whose order is dealt out

    def __post_init__(self) -> None:
        c, p, initial = self.num_canonical_nodes, self.num_physical_nodes, self.initial_physical_nodes
        if initial is None or (p <= c and c % p == 0) or (p > c and p % c == 0):
            nodes, batch = p, self.batch_size
        else:
            global_batch = p * self.ranks_per_node * self.batch_size
            if global_batch % (initial * self.ranks_per_node):
                raise ValueError(f"A global batch size of {global_batch} is not evenly divisible by the initial total "
                                 f"number of devices of {initial * self.ranks_per_node}")
            nodes, batch = initial, global_batch // (initial * self.ranks_per_node)
        object.__setattr__(self, "initial", Partition(self.num_samples, c, nodes, self.ranks_per_node,
                                                      self.workers_per_rank, batch, self.drop_first))

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        batches = self.initial.batches_per_worker
        return self.num_physical_nodes, self.ranks_per_node, self.workers_per_rank, batches, self.batch_size

    def ids(self, node: int, rank: int, worker: int, positions: np.ndarray | None = None) -> np.ndarray:
        """As Partition.ids: stock's array at [node, rank, worker], flattened, at `positions`."""
        b = self.batch_size
        if positions is None:
            positions = np.arange(self.initial.batches_per_worker * b, dtype=np.int64)
        batch, within = np.divmod(np.asarray(positions, np.int64), b)
        # Within one batch of one worker, the initial nodes' ranks' samples in turn, dealt to today's nodes' ranks.
        at = (node * self.ranks_per_node + rank) * b + within
        initial = self.initial
        old_rank, old_within = np.divmod(at, initial.batch_size)
        old_node, old_rank = np.divmod(old_rank, self.ranks_per_node)
        out = np.empty(batch.shape, np.int64)
        for node_then in np.unique(old_node):
            for rank_then in np.unique(old_rank[old_node == node_then]):
                chosen = (old_node == node_then) & (old_rank == rank_then)
                out[chosen] = initial.ids(int(node_then), int(rank_then), worker,
                                          batch[chosen] * initial.batch_size + old_within[chosen])
        return out

    def full(self) -> np.ndarray:
        """Every node, rank and worker's ids: stock's array, for tests."""
        return full_array(self)


def full_array(partition: Partition | RelaxedPartition) -> np.ndarray:
    """The partition as stock's array (nodes, ranks, workers, batches, batch), from its ids()."""
    out = np.empty(partition.shape, np.int64)
    nodes, ranks, workers, batches, batch = partition.shape
    for node in range(nodes):
        for rank in range(ranks):
            for worker in range(workers):
                out[node, rank, worker] = partition.ids(node, rank, worker).reshape(batches, batch)
    return out


class WorkerIds:
    """A worker's part of an epoch from sample_in_epoch on, as streaming hands a worker its work (its sample ids, -1
    where streaming pads), each slice computed when asked for: `len()` and `[start:stop]` are all that the door's
    download-ahead threads and yield loop use."""

    def __init__(self, order, partition: Partition | RelaxedPartition, node: int, rank: int,
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
