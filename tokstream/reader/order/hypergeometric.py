"""How many samples each shard gives a draw without replacement, at any size that fits an int64, the same in every
process and every numpy release: the project's own sampler, in Python integers where it can be and Python floats
(never numpy's generators, whose limits stop below 10^9 and whose streams a release may change) where it cannot.

`shard_counts(sizes, k, key)` splits k over the shards by a binary tree of univariate hypergeometric draws: the
count of a node's left half is Hypergeometric(left, right, k), the right half gets the rest, so the counts always sum
to k exactly and none exceeds its shard. Each tree node draws with its own key (the run's key and the node's number in
the tree), so a count does not depend on the order the tree is walked in.

A univariate draw takes its uniforms from the mixer of keyed.py: below SEQUENTIAL_BELOW picks it draws them one by one
with exact integer odds; above, Stadlober's ratio-of-uniforms (HRUA, numpy's own method for large samples), with the
log-factorials compared as differences (Stirling's series with log1p) so that populations of 10^11 and more keep their
precision, and the integer part of the mean kept apart from the float part.
"""

import math

import numpy as np

SEQUENTIAL_BELOW = 16
_MASK = (1 << 64) - 1
_D1 = 1.7155277699214135  # 2 sqrt(2/e)
_D2 = 0.8989161620588988  # 3 - 2 sqrt(3/e)


def _mix(z: int) -> int:
    """splitmix64's finaliser on a Python int (the same numbers as keyed.mix)."""
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & _MASK
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def key_of(*parts: int) -> int:
    """The parts folded into one 64-bit key (the same numbers as keyed.key)."""
    out = 0
    for part in parts:
        out = _mix(out ^ ((part + 0x9E3779B97F4A7C15) & _MASK))
    return out


class _Uniforms:
    """The keyed stream of 64-bit words a draw consumes, and what it makes of them."""

    def __init__(self, key: int):
        self.key, self.counter = key, 0

    def word(self) -> int:
        self.counter += 1
        return _mix(self.key ^ ((self.counter * 0x9E3779B97F4A7C15) & _MASK))

    def below(self, n: int) -> int:
        """A uniform integer in [0, n), n <= 2^64, exactly (rejection, no modulo bias)."""
        limit = ((1 << 64) // n) * n
        while True:
            w = self.word()
            if w < limit:
                return w % n

    def open01(self) -> float:
        """A uniform float in (0, 1)."""
        return ((self.word() >> 11) + 0.5) / (1 << 53)


def hypergeometric(good: int, bad: int, sample: int, key: int) -> int:
    """How many of `sample` draws without replacement from good + bad items are good."""
    total = good + bad
    if not 0 <= sample <= total or good < 0 or bad < 0:
        raise ValueError(f"cannot draw {sample} from {good} + {bad}")
    # Draw the smaller of sample and its complement, from the smaller of good and bad, then map back.
    drawn = min(sample, total - sample)
    fewer, more = min(good, bad), max(good, bad)
    uniforms = _Uniforms(key)
    if drawn == 0 or fewer == 0:
        hits = 0
    elif drawn < SEQUENTIAL_BELOW:
        hits, left = 0, total
        for _ in range(drawn):
            if uniforms.below(left) < fewer - hits:
                hits += 1
            left -= 1
    else:
        hits = _hrua(fewer, more, drawn, uniforms)
    if good > bad:
        hits = drawn - hits
    return hits if drawn == sample else good - hits


def _hrua(fewer: int, more: int, drawn: int, uniforms: _Uniforms) -> int:
    """Stadlober's ratio-of-uniforms for Hypergeometric(fewer, more, drawn), drawn <= total / 2, fewer <= more."""
    total = fewer + more
    p, q = fewer / total, more / total
    # a = drawn * p + 1/2, kept as an integer part and a fraction: X - base stays exact for any total.
    base, numerator = divmod(2 * drawn * fewer + total, 2 * total)
    fraction = numerator / (2 * total)
    var = (total - drawn) * drawn * p * q / (total - 1)
    c = math.sqrt(var + 0.5)
    h = _D1 * c + _D2
    mode = (drawn + 1) * (fewer + 1) // (total + 2)
    bound = min(min(drawn, fewer) + 1, base + math.floor(fraction + 16 * c))  # X < bound
    while True:
        u, v = uniforms.open01(), uniforms.open01()
        dx = fraction + h * (v - 0.5) / u  # X - base
        if dx < -base or dx >= bound - base:
            continue
        k = base + math.floor(dx)
        # T = log(f(k) / f(mode)), f the unnormalised density 1 / (k! (fewer-k)! (drawn-k)! (more-drawn+k)!)
        t = (_log_factorial_ratio(mode, k) + _log_factorial_ratio(fewer - mode, fewer - k)
             + _log_factorial_ratio(drawn - mode, drawn - k) + _log_factorial_ratio(more - drawn + mode, more - drawn + k))
        if u * (4.0 - u) - 3.0 <= t:
            return k
        if u * (u - t) >= 1:
            continue
        if 2.0 * math.log(u) <= t:
            return k


def _log_factorial_ratio(x: int, y: int) -> float:
    """log(x!) - log(y!), precise where both are large and close (Stirling's series, differences by log1p)."""
    if x == y:
        return 0.0
    if min(x, y) < 1 << 20:
        return math.lgamma(x + 1) - math.lgamma(y + 1)
    z1, z2 = float(y + 1), float(x + 1)
    d = float(x - y)
    return ((z1 - 0.5) * math.log1p(d / z1) + d * math.log(z2) - d
            + (1 / z2 - 1 / z1) / 12 - (1 / z2 ** 3 - 1 / z1 ** 3) / 360)


def shard_counts(sizes: np.ndarray, k: int, key: int) -> np.ndarray:
    """How many of k samples drawn without replacement from shards of these sizes fall in each shard."""
    sizes = np.asarray(sizes, np.int64)
    bounds = [0, *np.cumsum(sizes).tolist()]  # Python ints: exact at any total
    if not 0 <= k <= bounds[-1]:
        raise ValueError(f"cannot draw {k} samples from {bounds[-1]}")
    counts = np.zeros(len(sizes), np.int64)
    todo = [(0, len(sizes), k, 1)] if len(sizes) else []
    while todo:
        lo, hi, count, node = todo.pop()
        if count == 0:
            continue
        if count == bounds[hi] - bounds[lo]:
            counts[lo:hi] = sizes[lo:hi]
            continue
        if hi - lo == 1:
            counts[lo] = count
            continue
        mid = (lo + hi) // 2
        left = bounds[mid] - bounds[lo]
        in_left = hypergeometric(left, bounds[hi] - bounds[mid], count, key_of(key, node))
        todo += [(lo, mid, in_left, 2 * node), (mid, hi, count - in_left, 2 * node + 1)]
    return counts
