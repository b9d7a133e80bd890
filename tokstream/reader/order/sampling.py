"""Streaming's resampling (`get_sampling`, the first step of `resample_streams`), the same numbers, vectorized.

When a stream's epoch draws a fraction of its samples (every epoch cut to whole steps does), streaming shuffles the
stream's "picks" (one per sample at granularity 1) and adds them up in a Python loop until the epoch is full: 12-21 s
at 8.8 M samples on this machine. Here that is a slice of the shuffled picks and a count per shard, and when an
epoch leaves out only a few samples, only the last entries of numpy's permutation are drawn (`permutation_tail`).
Each is tested equal to streaming's on random inputs (tests/test_epoch_order.py); the door puts
`get_sampling_vectorized` where streaming calls its own.
"""

import numpy as np

# Below this many left-out picks, drawing them one by one in Python beats a whole permutation.
MAX_TAIL = 100_000


def get_sampling_vectorized(samples_per_shard: np.ndarray, choose: int, granularity: int, seed: int, epoch: int,
                            use_epoch: bool) -> np.ndarray:
    """streaming's `get_sampling`: how many samples the epoch draws from each shard of a stream that it draws
    `choose` samples from, picks of `granularity` samples shuffled by (seed, epoch if use_epoch)."""
    if choose < 0:
        raise ValueError(f"`choose` must be a non-negative integer, but got: {choose}.")
    if granularity <= 0:
        raise ValueError(f"`granularity` must be a positive integer, but got: {granularity}.")
    if seed < 0:
        raise ValueError(f"`seed` must be a non-negative integer, but got: {seed}.")
    if epoch < 0:
        raise ValueError("`epoch` must be a non-negative integer, but got: {epoch}.")  # stock's words, unformatted
    num_samples = int(np.sum(samples_per_shard))
    if not num_samples:  # a stream of empty shards: none drawn (stock's division by zero gives the same)
        return np.zeros_like(samples_per_shard)
    if not choose % num_samples:
        return samples_per_shard * choose // num_samples  # whole repeats, as stock computes them (its overflow)
    whole = samples_per_shard * (choose // num_samples)
    remainder, epoch_seed = choose % num_samples, seed + epoch if use_epoch else seed
    picked = _picked(samples_per_shard, num_samples, remainder, granularity, epoch_seed)
    return (whole + picked).astype(whole.dtype, copy=False)


def _picked(samples_per_shard: np.ndarray, num_samples: int, remainder: int, granularity: int,
            epoch_seed: int) -> np.ndarray:
    """Per shard, the samples of the `remainder` the shuffled picks fill (beyond the epoch's whole repeats)."""
    if granularity != 1:
        return _picked_in_granules(samples_per_shard, remainder, granularity, epoch_seed)
    ends = np.cumsum(samples_per_shard)

    def per_shard(picks: np.ndarray) -> np.ndarray:
        return np.bincount(np.searchsorted(ends, picks, side="right"), minlength=len(samples_per_shard))

    if num_samples - remainder <= MAX_TAIL:
        # An epoch cut to whole steps leaves out fewer picks than a step: count those, drawn alone.
        return samples_per_shard - per_shard(permutation_tail(epoch_seed, num_samples, num_samples - remainder))
    ordering = np.random.default_rng(epoch_seed).permutation(num_samples)
    if remainder <= num_samples // 2:
        return per_shard(ordering[:remainder])
    return samples_per_shard - per_shard(ordering[remainder:])


def _picked_in_granules(samples_per_shard: np.ndarray, remainder: int, granularity: int, epoch_seed: int) -> np.ndarray:
    """Per shard, the samples of the shuffled picks of `granularity` samples (a shard's last pick holds the rest)
    taken in order until `remainder` samples are taken, the last pick cut to fit: stock's loop, as sums."""
    picks_per_shard = (samples_per_shard + granularity - 1) // granularity
    pick_shard = np.repeat(np.arange(len(samples_per_shard)), picks_per_shard)
    pick_samples = np.full(len(pick_shard), granularity, np.int64)
    pick_samples[np.cumsum(picks_per_shard) - 1] = samples_per_shard - (picks_per_shard - 1) * granularity
    ordering = np.random.default_rng(epoch_seed).permutation(len(pick_shard))
    taken = np.cumsum(pick_samples[ordering])
    last = int(np.searchsorted(taken, remainder))  # the first pick that fills the epoch
    sizes = pick_samples[ordering[:last + 1]].copy()
    sizes[last] -= int(taken[last]) - remainder
    return np.bincount(pick_shard[ordering[:last + 1]], weights=sizes,
                       minlength=len(samples_per_shard)).astype(np.int64)


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


def resampled_shards(dataset, epoch: int) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """The first half of streaming's `resample_streams` (`dataset`: its attributes of the same names): how many samples the epoch takes from each
    shard, as the shuffle's units (each whole repeat of a shard, then the part), and per shard
    (shard id, its samples, how many the epoch takes)."""
    units, shards = [], []
    for stream_id in range(dataset.num_streams):
        shard_ids = dataset.shard_offset_per_stream[stream_id] + np.arange(dataset.shards_per_stream[stream_id])
        sizes = dataset.samples_per_shard[shard_ids]
        takes = get_sampling_vectorized(sizes, dataset.streams[stream_id].choose, dataset.sampling_granularity,
                                        dataset.shuffle_seed, epoch, dataset.epoch_seed_change)
        for shard_id, size, take in zip(shard_ids.tolist(), sizes.tolist(), takes.tolist()):
            if size:
                units += [size] * (take // size) + ([take % size] if take % size else [])
            shards.append((shard_id, size, take))
    return np.array(units, np.int64), shards


def resampled_sample_ids(dataset, epoch: int, shards: list[tuple[int, int, int]]) -> np.ndarray:
    """The second half of `resample_streams`: each resampled ("big") id's sample, from the same
    generator by the same calls, written into one array rather than concatenated from pieces.

    An epoch cut to whole steps leaves a sample or two out of most shards, so nearly every shard's
    part is drawn (`choice`) and put in order: by a mask, not a sort of each shard's ids (0.3 s of
    sorting at 8.8 M samples on this machine, beside the shuffle that the first batch waits on)."""
    seed = dataset.shuffle_seed + epoch if dataset.sampling_method == "balanced" else dataset.shuffle_seed
    rng = np.random.default_rng(seed)
    ids = np.empty(sum(take for _, _, take in shards), np.int64)
    at = 0
    for shard_id, size, take in shards:
        if not size:
            continue
        offset = int(dataset.sample_offset_per_shard[shard_id])
        for _ in range(take // size):
            ids[at:at + size] = np.arange(offset, offset + size)
            at += size
        if part := take % size:
            picked = np.zeros(size, bool)  # sorted, as stock sorts them: they are distinct, so a mask will do
            picked[rng.choice(size, part, False)] = True
            ids[at:at + part] = offset + np.flatnonzero(picked)
            at += part
    return ids
