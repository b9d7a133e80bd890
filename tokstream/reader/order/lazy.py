"""The lazy order (data.shuffle_algo: lazy): an epoch's order computed where it is read, position by position, in
O(log shards) a sample after O(shards log shards) set-up, with no array of the epoch's size, nothing in shared memory,
and the same numbers in every process, numpy release and CPU (keyed.py, hypergeometric.py: integer mixing only).

An epoch is built in three steps, each a function of a position:

- the resampling: each stream's whole repeats of each shard, and for the part of a repeat its `choose` leaves, how
  many samples each shard gives (hypergeometric.shard_counts: as many as drawing them without replacement would give
  it, exact at any size) and which (the first of the shard's keyed bijection). Each (shard, repeat) is a unit;
- the shuffle, py1e's shape: the units in an order fixed for the run, cut into the canonical nodes' equal ranges,
  each node's pieces in an order of the epoch; positions permuted inside windows of `block_size` of a node's range,
  and every unit's samples permuted (keyed by seed, epoch, shard and repeat), so a shard is read in a new order every
  epoch whatever the block;
- the partition (partition.py): streaming's own, in closed form.
"""

import numpy as np

from tokstream.reader.order.hypergeometric import key_of, shard_counts
from tokstream.reader.order.keyed import key, permutation

NAME = "lazy"
# Key domains, so that no two of the order's draws share a key.
_RESAMPLE, _RUN, _EPOCH, _WINDOW, _UNIT, _PICK = 1, 2, 3, 4, 5, 6


def windows(positions: np.ndarray, epoch_size: int, num_canonical_nodes: int,
            block_size: int) -> tuple[np.ndarray, ...]:
    """Each position's canonical node, its window of `block_size` positions in that node's range (counted from the
    node's start), the window's first position and its size (the node's last window may be shorter)."""
    n, nodes = epoch_size, num_canonical_nodes
    node = ((positions + 1) * nodes + n - 1) // max(n, 1) - 1  # the largest c with c * n // nodes <= position
    node_start, node_end = node * n // nodes, (node + 1) * n // nodes
    window = (positions - node_start) // block_size
    window_start = node_start + window * block_size
    return node, window, window_start, np.minimum(block_size, node_end - window_start)


class EpochOrder:
    """Position in the epoch's order -> sample id, for a dataset's shards (in its streams' order)."""

    def __init__(self, samples_per_shard: np.ndarray, shards_per_stream: list[int], chooses: list[int | None],
                 seed: int, epoch: int, num_canonical_nodes: int, block_size: int):
        if block_size < 1 or num_canonical_nodes < 1:
            raise ValueError(f"block_size {block_size} and num_canonical_nodes {num_canonical_nodes} must be positive")
        sizes = np.asarray(samples_per_shard, np.int64)
        self.seed, self.epoch, self.block_size = int(seed), int(epoch), int(block_size)
        self.num_canonical_nodes = int(num_canonical_nodes)
        self.shard_sizes = sizes
        self.shard_offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self._resample(sizes, shards_per_stream, chooses)
        self.epoch_size = int(self.unit_sizes.sum())
        if self.epoch_size * (self.num_canonical_nodes + 1) >= 1 << 63:  # windows()' largest intermediate
            raise ValueError(f"an epoch of {self.epoch_size} samples over {num_canonical_nodes} canonical nodes does "
                             "not fit the order's int64 arithmetic")
        self._lay_out()

    def _resample(self, sizes: np.ndarray, shards_per_stream: list[int], chooses: list[int | None]) -> None:
        """The units: each shard's whole repeats (its size), then a partial one (the samples it gives the rest)."""
        shards, nths, unit_sizes, partial = [], [], [], []
        first = 0
        for stream, count in enumerate(shards_per_stream):
            stream_sizes = sizes[first:first + count]
            total = int(stream_sizes.sum())
            choose = total if chooses[stream] is None else int(chooses[stream])
            if not total and choose:
                raise ValueError(f"stream {stream} has no samples to give the {choose} its epoch takes")
            repeats, rest = divmod(choose, total) if total else (0, 0)
            takes = shard_counts(stream_sizes, rest, key_of(self.seed, self.epoch, stream, _RESAMPLE)) if rest else \
                np.zeros(count, np.int64)
            per_shard = np.where(stream_sizes > 0, repeats + (takes > 0), 0)  # an empty shard gives nothing
            shard = np.repeat(np.arange(count), per_shard)
            nth = np.arange(len(shard)) - np.repeat(np.cumsum(per_shard) - per_shard, per_shard)
            shards.append(shard + first)
            nths.append(nth)
            unit_sizes.append(np.where(nth < repeats, stream_sizes[shard], takes[shard]))
            partial.append(nth >= repeats)
            first += count
        self.unit_shards = np.concatenate(shards).astype(np.int64)
        self.unit_nths = np.concatenate(nths).astype(np.int64)
        self.unit_sizes = np.concatenate(unit_sizes).astype(np.int64)
        self.unit_partial = np.concatenate(partial).astype(bool)

    def _lay_out(self) -> None:
        """The pieces of units each position range reads: the units in the run's order, cut at the canonical nodes'
        bounds, each node's pieces in the epoch's order."""
        run_order = np.argsort(key(self.seed, _RUN, self.unit_shards, self.unit_nths), kind="stable")
        lengths = self.unit_sizes[run_order]
        starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)  # each unit's place in the run's order
        n, nodes = self.epoch_size, self.num_canonical_nodes
        bounds = np.arange(nodes + 1, dtype=np.int64) * n // nodes if n else np.zeros(nodes + 1, np.int64)
        cuts = np.union1d(starts[:-1][lengths > 0], bounds[:-1])
        cuts = cuts[cuts < n]
        piece_lengths = np.diff(np.append(cuts, n))
        unit_at = np.searchsorted(starts, cuts, side="right") - 1
        node_at = np.searchsorted(bounds, cuts, side="right") - 1
        # Each node's pieces in an order of the epoch: sorted by node, then by a key of the piece's unit and place.
        units = run_order[unit_at]
        shuffled = np.lexsort((key(self.seed, self.epoch, _EPOCH, units, cuts - starts[unit_at]), node_at))
        self.piece_units = units[shuffled]
        self.piece_within = (cuts - starts[unit_at])[shuffled]  # where in its unit the piece begins
        self.piece_offsets = np.concatenate([[0], np.cumsum(piece_lengths[shuffled])]).astype(np.int64)

    def at(self, positions: np.ndarray) -> np.ndarray:
        """The sample at each position (0 <= position < epoch_size) of the epoch's order."""
        positions = np.asarray(positions, np.int64)
        if positions.size and (positions.min() < 0 or positions.max() >= self.epoch_size):
            raise IndexError(f"positions from {positions.min()} to {positions.max()} in an epoch of {self.epoch_size}")
        node, window, window_start, size = windows(positions, self.epoch_size, self.num_canonical_nodes,
                                                   self.block_size)
        moved = window_start + permutation(positions - window_start, size,
                                           key(self.seed, self.epoch, _WINDOW, node, window))
        piece = np.searchsorted(self.piece_offsets, moved, side="right") - 1
        unit = self.piece_units[piece]
        within = self.piece_within[piece] + moved - self.piece_offsets[piece]
        shard = self.unit_shards[unit]
        # A whole repeat reads its shard under a keyed permutation (seed, epoch, shard, repeat); a shard's part of a
        # repeat reads the first `take` of the shard's keyed permutation (seed, epoch, shard), which already picks
        # them in a random order.
        whole = ~self.unit_partial[unit]
        within[whole] = permutation(within[whole], self.unit_sizes[unit[whole]],
                                    key(self.seed, self.epoch, _UNIT, shard[whole], self.unit_nths[unit[whole]]))
        picked = ~whole
        within[picked] = permutation(within[picked], self.shard_sizes[shard[picked]],
                                     key(self.seed, self.epoch, _PICK, shard[picked]))
        return self.shard_offsets[shard] + within
