"""Streaming's epoch order, the same numbers, computed without a Python step or a full array per sample.

At every epoch start and every resume the first rank of each node computes the epoch's sample order
before any rank gets a batch: at OpenWebText's 8.8 M samples that took seconds (bench/scale.py).
The replacements here return what streaming's functions return, and are put in their place when
this module is imported (through streaming_internals.py, as every use of streaming's internals):

- `get_sampling_vectorized` for streaming's `get_sampling`: how many samples an epoch draws from
  each shard when it draws a fraction of a stream (every epoch cut to whole steps does);
- `permutation_tail`: the last entries of numpy's `Generator.permutation`, which is all that
  sampling needs when an epoch leaves out only a few samples;
- `get_shuffle_py1e_lean` for streaming's `py1e` shuffle (the default): the same random draws and
  the same sort, in 3 arrays of the epoch's size at most instead of 5.

Each is tested equal to the original on random inputs (tests/test_fast_reader.py).
"""

import warnings

import numpy as np

from tokstream.train import streaming_internals as internals
from tokstream.train.streaming_internals import divide_spans, stock_get_sampling

# Below this many left-out picks, drawing them one by one in Python beats a whole permutation.
MAX_TAIL = 100_000


def get_sampling_vectorized(samples_per_shard: np.ndarray, choose: int, granularity: int, seed: int, epoch: int,
                            use_epoch: bool) -> np.ndarray:
    """streaming's `get_sampling`, the same numbers, without its Python loop over every sample.

    When a stream's epoch draws a fraction of its samples, streaming shuffles the stream's "picks"
    (one per sample at granularity 1) and adds them up in a Python loop until the epoch is full:
    12-21 s at 8.8 M samples on this machine. At streaming's default granularity of one sample per
    pick, the loop takes the first `remainder` shuffled picks, which is a slice and a count per shard.
    """
    num_samples = int(np.sum(samples_per_shard))
    if granularity != 1 or choose < 0 or seed < 0 or epoch < 0 or not choose % num_samples:
        # Its checks, its whole-repeat case, and a sampling_granularity this project never sets.
        return stock_get_sampling(samples_per_shard, choose, granularity, seed, epoch, use_epoch)
    remainder, epoch_seed = choose % num_samples, seed + epoch if use_epoch else seed
    ends = np.cumsum(samples_per_shard)
    whole = samples_per_shard * (choose // num_samples)

    def per_shard(picks: np.ndarray) -> np.ndarray:
        return np.bincount(np.searchsorted(ends, picks, side="right"), minlength=len(samples_per_shard))

    if num_samples - remainder <= MAX_TAIL:
        # An epoch cut to whole steps leaves out fewer picks than a step: count those, drawn alone.
        return whole + samples_per_shard - per_shard(permutation_tail(epoch_seed, num_samples, num_samples - remainder))
    ordering = np.random.default_rng(epoch_seed).permutation(num_samples)
    if remainder <= num_samples // 2:
        return whole + per_shard(ordering[:remainder])
    return whole + samples_per_shard - per_shard(ordering[remainder:])


def permutation_tail(seed: int, n: int, count: int) -> np.ndarray:
    """`np.random.default_rng(seed).permutation(n)[n - count:]`, in time and memory of `count`, not `n`.

    numpy's permutation is a Fisher-Yates shuffle of arange(n) that fixes the last position first:
    for i from n - 1 down, it swaps position i with j = random_interval(i), the smallest all-ones mask
    over i applied to 32-bit draws (64-bit above 2^32 - 1) until one is at most i. PCG64 serves a
    32-bit draw as the low half of a 64-bit one and keeps the high half for the next. So the last
    `count` positions need only the first `count` swaps, replayed here on the few positions they touch.
    """
    bits = np.random.PCG64(seed)  # what default_rng(seed) draws from
    moved: dict[int, int] = {}  # position -> value, where the swaps so far changed arange(n)
    tail = np.empty(count, np.int64)
    spare: int | None = None  # the high half of the last 64-bit draw, served as the next 32-bit one
    first = n - count
    for i in range(n - 1, max(first, 1) - 1, -1):
        mask = (1 << i.bit_length()) - 1
        while True:
            if i > 0xFFFFFFFF:
                value = int(bits.random_raw())
            elif spare is None:
                raw = int(bits.random_raw())
                value, spare = raw & 0xFFFFFFFF, raw >> 32
            else:
                value, spare = spare, None
            value &= mask
            if value <= i:
                break
        tail[i - first] = moved.get(value, value)
        moved[value] = moved.get(i, i)
    if first == 0:  # position 0 is never drawn for: it keeps what the swaps left there
        tail[0] = moved.get(0, 0)
    return tail


def get_shuffle_py1e_lean(shard_sizes: np.ndarray, num_canonical_nodes: int, seed: int, epoch: int,
                          block_size: int = 1 << 18) -> np.ndarray:
    """streaming's `get_shuffle_py1e`, the same ids, in 3 arrays of the epoch's size at most, not 5.

    Its steps, in its order: shards in a run-wide shuffled order cut at canonical node boundaries,
    each node's spans shuffled this epoch, each span's samples shuffled, each sample moved by a
    uniform shift within a block and the node's samples sorted by position (numpy's default
    argsort, as there). Stock holds the node's samples as float64 beside their positions, the sort
    order and two copies of the result; here the samples go straight into the output and the
    positions' memory takes the reordered copy: 210 MB instead of 350 MB at OpenWebText's 8.8 M.
    """
    spans, num_samples = [], 0
    for shard_size in shard_sizes:
        spans.append((num_samples, num_samples + shard_size))
        num_samples += shard_size
    np.random.default_rng(seed).shuffle(spans)
    spans, super_spans = divide_spans(spans, num_samples, num_canonical_nodes)
    epoch_rng = np.random.default_rng(seed + epoch)
    for begin, end in super_spans:
        part = spans[begin:end]
        epoch_rng.shuffle(part)
        spans[begin:end] = part

    ids = np.empty(num_samples, np.int64)
    offset, unshuffled_spans = 0, False
    for node_begin, node_end in super_spans:
        node_spans = spans[node_begin:node_end]
        span_sizes = [end - begin for begin, end in node_spans]
        node_samples = int(sum(span_sizes))
        if node_samples == 0:
            raise ValueError(f"The number of samples assigned to a canonical node is 0: the stream has fewer "
                             f"samples than num_canonical_nodes ({num_canonical_nodes}); reduce num_canonical_nodes.")
        samples = ids[offset:offset + node_samples]
        inserted = 0
        for begin, end in node_spans:
            span_samples = np.arange(begin, end)
            epoch_rng.shuffle(span_samples)
            samples[inserted:inserted + end - begin] = span_samples
            inserted += end - begin
        positions = np.arange(node_samples, dtype=np.float64)
        span_offset = 0
        for span_size in span_sizes:
            block = epoch_rng.integers(int(0.75 * block_size), int(1.25 * block_size))
            cutoff = (block - span_size) / 2
            if cutoff < 0:
                cutoff, unshuffled_spans = 0, True
            low = max(-cutoff, -span_offset)
            high = min(cutoff, node_samples - span_offset - span_size)
            positions[span_offset:span_offset + span_size] += epoch_rng.uniform(low=low, high=high, size=span_size)
            span_offset += span_size
        order = np.argsort(positions)
        reordered = positions.view(np.int64)  # the positions are spent: their memory takes the result
        np.take(samples, order, out=reordered)
        samples[:] = reordered
        del order, positions, reordered
        offset += node_samples
    if unshuffled_spans:
        warnings.warn("Shuffle block size was smaller than shard size for some shards. This will result in "
                      "these shards not being shuffled with other shards. Set shuffle_block_size to a larger "
                      "value for a higher quality shuffle.")
    return ids


internals.install_epoch_order(get_sampling_vectorized, get_shuffle_py1e_lean)
