"""tokstream/train/epoch_order.py against the streaming and numpy functions it stands in for: equal results.

These replacements decide which samples an epoch holds and in which order, so "equal" is exact
equality on random inputs, covering each path they take.
"""

import warnings

import numpy as np
import pytest

from tokstream.train import epoch_order
from tokstream.train.epoch_order import get_sampling_vectorized, get_shuffle_py1e_lean, permutation_tail
from tokstream.train.streaming_internals import epoch_order_in_force, get_shuffle, stock_get_sampling
from tokstream.train.streaming_internals import stock_get_shuffle_py1e as get_shuffle_py1e


def test_the_tail_of_numpys_permutation_drawn_alone_is_numpys():
    rng = np.random.default_rng(0)
    cases = [(1, 1, 5), (2, 1, 0), (2, 2, 3), (3, 3, 9)]
    cases += [(int(n), int(rng.integers(1, n + 1)), int(rng.integers(0, 2**32))) for n in rng.integers(1, 3000, 300)]
    for n, count, seed in cases:
        np.testing.assert_array_equal(permutation_tail(seed, n, count),
                                      np.random.default_rng(seed).permutation(n)[n - count:], err_msg=str((n, count, seed)))


@pytest.mark.parametrize("max_tail", [epoch_order.MAX_TAIL, 0])  # 0: the whole-permutation path
def test_the_vectorized_sampling_draws_what_streamings_loop_draws(monkeypatch, max_tail):
    """How many samples an epoch draws from each shard when it takes a fraction of a stream (every epoch cut
    to whole steps does), in force in every dataset (streaming_internals.py), against streaming's own."""
    assert epoch_order_in_force(get_sampling_vectorized, get_shuffle_py1e_lean)
    monkeypatch.setattr(epoch_order, "MAX_TAIL", max_tail)
    rng = np.random.default_rng(max_tail)
    for _ in range(400):
        shards = rng.integers(1, 60, rng.integers(1, 12)).astype(np.int64)
        args = (shards, int(rng.integers(0, 4 * shards.sum())), int(rng.choice([1, 1, 1, 2, 3, 7, 100])),
                int(rng.integers(0, 1000)), int(rng.integers(0, 5)), bool(rng.integers(0, 2)))
        np.testing.assert_array_equal(get_sampling_vectorized(*args), stock_get_sampling(*args), err_msg=str(args))
    with pytest.raises(ValueError, match="must be a non-negative integer"):
        get_sampling_vectorized(shards, -1, 1, 0, 0, True)


def test_the_lean_py1e_shuffle_is_streamings_and_is_the_one_in_force():
    assert epoch_order_in_force(get_sampling_vectorized, get_shuffle_py1e_lean)
    rng = np.random.default_rng(1)
    for _ in range(60):
        shards = rng.integers(1, 3000, rng.integers(1, 40)).astype(np.int64)
        args = (shards, int(rng.integers(1, min(9, shards.sum()) + 1)), int(rng.integers(0, 2**31)),
                int(rng.integers(0, 5)), int(rng.choice([1000, 5000, 1 << 18])))
        with warnings.catch_warnings(record=True) as stock_warned:
            warnings.simplefilter("always")
            expected = get_shuffle_py1e(*args)
        with warnings.catch_warnings(record=True) as lean_warned:
            warnings.simplefilter("always")
            got = get_shuffle("py1e", *args)
        np.testing.assert_array_equal(got, expected, err_msg=str(args))
        assert got.dtype == expected.dtype and len(lean_warned) == len(stock_warned)
    with pytest.raises(ValueError, match="canonical node is 0"):
        get_shuffle_py1e_lean(np.array([1], dtype=np.int64), 2, 0, 0)
