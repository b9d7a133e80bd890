"""Keyed randomness that every process recomputes alike, whatever numpy's version or the CPU: only integer
arithmetic on uint64 (a splitmix64 mixer), no generator whose stream a release may change.

- `mix`, `key`: a uint64 per element, from parts folded in through the mixer;
- `permutation`: each offset moved by a keyed bijection of [0, size), sizes up to 2^62. Up to EXACT_UP_TO elements
  the bijection is the ranks of the key's hashes of 0..size-1: a uniform permutation (as uniform as the hash). Above,
  a Feistel network over the smallest power of 4 holding the size, walked until it lands inside (fewer than 4 steps
  on average), with enough rounds that no element favours a place (tests/test_order_keyed.py measures it).
"""

import numpy as np

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
EXACT_UP_TO = 64
ROUNDS = 8


def mix(values: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping): a keyed round's pseudo-random function."""
    z = np.asarray(values).astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        z ^= z >> np.uint64(30)
        z *= np.uint64(0xBF58476D1CE4E5B9)
        z ^= z >> np.uint64(27)
        z *= np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return z


def key(*parts: np.ndarray | int) -> np.ndarray:
    """One uint64 per element of the parts (broadcast together), each part folded in through the mixer."""
    out = np.zeros(np.broadcast(*[np.asarray(p) for p in parts]).shape, np.uint64)
    for part in parts:
        with np.errstate(over="ignore"):
            out = mix(out ^ (np.asarray(part).astype(np.uint64) + GOLDEN))
    return out


def permutation(offsets: np.ndarray, sizes: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Each offset (0 <= offset < its size) moved by the keyed bijection of [0, size) its key picks (int64)."""
    offsets, sizes, keys = np.broadcast_arrays(np.asarray(offsets, np.int64), np.asarray(sizes, np.int64),
                                               np.asarray(keys, np.uint64))
    if offsets.size and ((offsets < 0) | (offsets >= sizes)).any():  # the walk would never land
        raise ValueError("an offset outside its range [0, size) has no place in a permutation of it")
    out = np.empty(offsets.shape, np.int64)
    small = sizes <= EXACT_UP_TO
    if small.any():
        out[small] = _ranks(offsets[small], sizes[small], keys[small])
    if not small.all():
        out[~small] = _feistel(offsets[~small], sizes[~small], keys[~small])
    return out


def _ranks(offsets: np.ndarray, sizes: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """The rank of each offset's hash among its window's (ties by offset): a uniform permutation of a small window."""
    others = np.arange(EXACT_UP_TO, dtype=np.uint64)
    hashes = key(keys[:, None], others[None, :])  # (n, EXACT_UP_TO)
    own = hashes[np.arange(len(offsets)), offsets]
    inside = others[None, :] < sizes[:, None].astype(np.uint64)
    before = (hashes < own[:, None]) | ((hashes == own[:, None]) & (others[None, :] < offsets[:, None].astype(np.uint64)))
    return (before & inside).sum(axis=1).astype(np.int64)


def _feistel(offsets: np.ndarray, sizes: np.ndarray, keys: np.ndarray) -> np.ndarray:
    # The elements still walking, each with its own bits, mask, size and round keys, kept compact between passes.
    at = np.arange(len(offsets))
    x, size, b = offsets.astype(np.uint64), sizes.astype(np.uint64), _half_bits(sizes)
    m = (np.uint64(1) << b) - np.uint64(1)
    round_keys = [mix(keys ^ np.uint64(0xA5A5A5A5 + r)) for r in range(ROUNDS)]
    out = np.empty(len(offsets), np.int64)
    while len(at):
        left, right = x >> b, x & m
        for round_key in round_keys:
            left, right = right, left ^ (mix(right ^ round_key) & m)
        x = (left << b) | right
        inside = x < size
        out[at[inside]] = x[inside].astype(np.int64)
        walking = ~inside
        at, x, size, b, m = at[walking], x[walking], size[walking], b[walking], m[walking]
        round_keys = [round_key[walking] for round_key in round_keys]
    return out


def _half_bits(sizes: np.ndarray) -> np.ndarray:
    """Half the bits of the smallest power of 4 that holds each size (integers only: exact to 2^62)."""
    length = np.zeros(sizes.shape, np.int64)  # the bit length of size - 1
    rest = sizes - 1
    for shift in (32, 16, 8, 4, 2, 1):
        over = rest >= (1 << shift)
        length += np.where(over, shift, 0)
        rest = np.where(over, rest >> shift, rest)
    length += rest > 0
    return np.maximum(1, (length + 1) // 2).astype(np.uint64)
