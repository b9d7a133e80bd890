"""A shuffle whose order is computed where it is read: sample at any position of an epoch in O(1), after O(shards)
set-up, with no array of the epoch's size (streaming's shuffles build one: 8 bytes per sample, at every epoch start
and every resume).

It keeps what streaming's py1s/py1e shuffles keep, so that a canonical node still reads from a few shards at a
time: the shards in an order fixed for the run (seed), cut into the canonical nodes' equal ranges
(streaming's own divide_spans), and each node's spans in an order of the epoch (seed + epoch). Then, instead of
shuffling every span in memory, positions are permuted inside windows of `block_size` consecutive positions of a
node's range by a keyed bijection: a Feistel network over the smallest power of 4 that holds the window, walked
until it lands inside (fewer than 4 steps on average). The key is (seed, epoch, canonical node, window).

Registered in streaming's shuffle algorithms as "feistel_window" by the door's install(), so that stock
StreamingDataset reads in this order too (tests/test_lazy_shuffle.py compares them).
"""

from dataclasses import dataclass, field

import numpy as np

NAME = "feistel_window"
ROUNDS = 4
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(values: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a keyed round's pseudo-random function, on uint64 arrays (wrapping)."""
    z = values.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        z ^= z >> np.uint64(30)
        z *= np.uint64(0xBF58476D1CE4E5B9)
        z ^= z >> np.uint64(27)
        z *= np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return z


def _key(*parts: np.ndarray | int) -> np.ndarray:
    """One uint64 per element from the parts (broadcast), each folded in through the mixer."""
    key = np.zeros(np.broadcast(*[np.asarray(p) for p in parts]).shape, np.uint64)
    for part in parts:
        with np.errstate(over="ignore"):
            key = _mix(key ^ (np.asarray(part).astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)))
    return key


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
        from tokstream.reader.streaming_door.streaming_internals import divide_spans  # stock's own cut

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
        n, nodes = self.num_samples, self.num_canonical_nodes
        node = ((positions + 1) * nodes + n - 1) // max(n, 1) - 1  # the largest c with c * n // nodes <= position
        node_start, node_end = node * n // nodes, (node + 1) * n // nodes
        window = (positions - node_start) // self.block_size
        window_start = node_start + window * self.block_size
        size = np.minimum(self.block_size, node_end - window_start)
        keys = _key(self.seed, self.epoch, node, window)
        moved = window_start + window_permutation(positions - window_start, size, keys).astype(np.int64)
        span = np.searchsorted(self.span_offsets, moved, side="right") - 1
        return self.span_starts[span] + moved - self.span_offsets[span]

    def full(self) -> np.ndarray:
        return self.at(np.arange(self.num_samples, dtype=np.int64))


def get_shuffle_feistel_window(shard_sizes: np.ndarray, num_canonical_nodes: int, seed: int, epoch: int,
                               block_size: int = 1 << 18) -> np.ndarray:
    """streaming's shuffle interface (shuffle.algos): the whole epoch's order, as stock reads it."""
    return WindowShuffle(tuple(int(s) for s in shard_sizes), num_canonical_nodes, seed, epoch, block_size).full()
