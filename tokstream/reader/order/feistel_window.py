"""The first lazy order (data.shuffle_algo: feistel_window), kept number for number for the runs and reader states that
were read in it: a run never changes order under it (docs/scale.md). New runs read in the lazy order (lazy.py), which
shuffles inside every shard whatever the block and draws at any size; this one permutes only inside windows of
`shuffle_block_size`, so a block below the shard size leaves each shard read in ascending chunks, and its resampling
is numpy's multivariate hypergeometric draw, which stops below 10^9 samples.

Its shuffle keeps py1s/py1e's steps: the shards in an order fixed for the run (seed), cut into the canonical nodes'
equal ranges (divide_spans, streaming's cut), each node's spans in an order of the epoch (seed + epoch); positions
permuted inside windows of `block_size` of a node's range by a 4-round keyed Feistel bijection, key (seed, epoch,
canonical node, window). Registered in streaming's shuffles by the door, so stock StreamingDataset reads it too.
"""

from dataclasses import dataclass, field

import numpy as np

from tokstream.reader.order.keyed import key as _key
from tokstream.reader.order.keyed import mix as _mix
from tokstream.reader.order.lazy import windows
from tokstream.reader.order.py1e import divide_spans

NAME = "feistel_window"
ROUNDS = 4


def window_permutation(offsets: np.ndarray, sizes: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Each offset (below its window's size) moved by its window's keyed bijection of [0, size)."""
    offsets = np.asarray(offsets, np.uint64)
    sizes = np.asarray(sizes, np.uint64)
    bits = np.maximum(1, np.ceil(np.log2(np.maximum(sizes, 2).astype(np.float64)) / 2)).astype(np.uint64)
    half_mask = (np.uint64(1) << bits) - np.uint64(1)
    out = offsets.copy()
    walking = np.ones(out.shape, bool)
    round_keys = [_mix(keys ^ np.uint64(r + 1)) for r in range(ROUNDS)]
    while walking.any():  # cycle walking: apply the permutation of the power-of-4 domain until inside [0, size)
        x = out[walking]
        b, m = bits[walking], half_mask[walking]
        left, right = x >> b, x & m
        for round_key in round_keys:
            with np.errstate(over="ignore"):
                left, right = right, left ^ (_mix(right ^ round_key[walking]) & m)
        out[walking] = (left << b) | right
        walking &= out >= sizes
    return out
@dataclass(frozen=True)
class WindowShuffle:
    """The order of one epoch: `at(positions)` gives the sample at each position, `full()` all of them (stock's
    array, for streaming and for tests)."""

    shard_sizes: tuple[int, ...]
    num_canonical_nodes: int
    seed: int
    epoch: int
    block_size: int
    span_starts: np.ndarray = field(init=False, repr=False)  # first sample id of each span, in reading order
    span_offsets: np.ndarray = field(init=False, repr=False)  # the position each span begins at
    num_samples: int = field(init=False)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.num_canonical_nodes < 1:
            raise ValueError(f"block_size {self.block_size} and num_canonical_nodes {self.num_canonical_nodes} must "
                             "be positive")
        sizes = np.asarray(self.shard_sizes, np.int64)
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        spans = list(zip(starts.tolist(), (starts + sizes).tolist()))  # Python ints: 27 K shards in 3 ms
        num_samples = int(sizes.sum())
        np.random.default_rng(self.seed).shuffle(spans)  # the shards' order, fixed for the run (as py1s)
        spans, super_spans = divide_spans(spans, num_samples, self.num_canonical_nodes)
        epoch_rng = np.random.default_rng(self.seed + self.epoch)
        for begin, end in super_spans:  # each node's spans in an order of the epoch
            part = spans[begin:end]
            epoch_rng.shuffle(part)
            spans[begin:end] = part
        span_starts = np.array([begin for begin, _ in spans], np.int64)
        lengths = np.array([end - begin for begin, end in spans], np.int64)
        object.__setattr__(self, "span_starts", span_starts)
        object.__setattr__(self, "span_offsets", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
        object.__setattr__(self, "num_samples", num_samples)

    def at(self, positions: np.ndarray) -> np.ndarray:
        """The sample id at each position of the epoch's order."""
        positions = np.asarray(positions, np.int64)
        node, window, window_start, size = windows(positions, self.num_samples, self.num_canonical_nodes,
                                                   self.block_size)
        keys = _key(self.seed, self.epoch, node, window)
        moved = window_start + window_permutation(positions - window_start, size, keys).astype(np.int64)
        span = np.searchsorted(self.span_offsets, moved, side="right") - 1
        return self.span_starts[span] + moved - self.span_offsets[span]

    def full(self) -> np.ndarray:
        return self.at(np.arange(self.num_samples, dtype=np.int64))


class FeistelWindowOrder:
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


def get_shuffle_feistel_window(shard_sizes: np.ndarray, num_canonical_nodes: int, seed: int, epoch: int,
                               block_size: int = 1 << 18) -> np.ndarray:
    """streaming's shuffle interface (shuffle.algos): the whole epoch's order, as stock reads it."""
    return WindowShuffle(tuple(int(s) for s in shard_sizes), num_canonical_nodes, seed, epoch, block_size).full()
