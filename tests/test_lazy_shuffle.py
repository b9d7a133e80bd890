"""tokstream/reader/order/feistel_window.py, the first lazy order: a shuffle computed where it is read (O(1) a
position): a permutation of every epoch, the same at any position as in the whole array, keeping streaming's
assignment of shards to canonical nodes."""

import numpy as np
import pytest

from tokstream.reader.order.feistel_window import NAME, WindowShuffle, get_shuffle_feistel_window
from tokstream.reader.order.py1e import divide_spans
from tokstream.reader.streaming_door.streaming_internals import get_shuffle  # stock streaming's own


def random_layouts(rng: np.random.Generator, count: int):
    for _ in range(count):
        shards = rng.integers(0, 300, int(rng.integers(1, 40)))
        yield shards, int(rng.integers(1, 9)), int(rng.integers(0, 2**31)), int(rng.integers(0, 5)), \
            int(rng.choice([1, 2, 7, 64, 1000, 1 << 18]))


def test_every_epoch_is_a_permutation_the_same_at_any_position_and_each_node_keeps_py1s_shards():
    for shards, nodes, seed, epoch, block in random_layouts(np.random.default_rng(0), 300):
        order = get_shuffle_feistel_window(shards, nodes, seed, epoch, block)
        assert np.array_equal(np.sort(order), np.arange(shards.sum())), (shards, nodes, block)
        shuffle = WindowShuffle(tuple(shards.tolist()), nodes, seed, epoch, block)
        picks = np.random.default_rng(seed).integers(0, max(1, shards.sum()), 50) if shards.sum() else []
        assert np.array_equal(shuffle.at(picks), order[picks])
        # Streaming's py1s puts the same samples in each canonical node's range (only their order differs).
        stock = get_shuffle("py1s", shards, nodes, seed, epoch, block)
        n = int(shards.sum())
        for node in range(nodes):
            begin, end = node * n // nodes, (node + 1) * n // nodes
            assert np.array_equal(np.sort(order[begin:end]), np.sort(stock[begin:end])), (node, shards, nodes)


def test_epochs_and_seeds_give_other_orders_and_windows_stay_in_place():
    shards = np.full(20, 100)
    first = get_shuffle_feistel_window(shards, 2, 7, 0, 64)
    assert not np.array_equal(first, get_shuffle_feistel_window(shards, 2, 7, 1, 64))
    assert not np.array_equal(first, get_shuffle_feistel_window(shards, 2, 8, 0, 64))
    assert np.array_equal(first, get_shuffle_feistel_window(shards, 2, 7, 0, 64))
    # A window is a range of positions: its samples are those the node's spans put there, in another order.
    unshuffled = get_shuffle_feistel_window(shards, 2, 7, 0, 1)  # windows of one position: the spans' order
    for begin in range(0, 1000, 64):
        end = min(begin + 64, 1000)
        assert sorted(first[begin:end]) == sorted(unshuffled[begin:end])
    assert (first[:64] != unshuffled[:64]).mean() > 0.9


def test_a_position_of_an_880_million_sample_epoch_costs_what_it_costs_in_a_small_one():
    shards = np.full(880_000, 1000)  # 880 M samples in shards of 1,000: O(shards) set-up, then O(1) a position
    shuffle = WindowShuffle(tuple(shards.tolist()), 8, 9176, 3, 500_000)
    picks = np.array([0, 1, 109_999_999, 110_000_000, 879_999_999])
    got = shuffle.at(picks)
    assert got.min() >= 0 and got.max() < 880_000_000 and len(set(got.tolist())) == 5


def test_the_cut_at_canonical_nodes_is_streamings_own():
    """feistel_window cuts its spans as streaming's divide_spans does (empty shards included: they move the epoch's
    draws), without importing it: the order package imports none of streaming."""
    from tokstream.reader.streaming_door.streaming_internals import divide_spans as stock_divide_spans

    rng = np.random.default_rng(5)
    for _ in range(2000):
        sizes = rng.integers(0, 40, int(rng.integers(1, 30))) * rng.integers(0, 2, 1)[0] + rng.integers(0, 3, 1)[0]
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        spans = [(int(a), int(a + s)) for a, s in zip(starts, sizes)]
        rng.shuffle(spans)
        n, parts = int(sizes.sum()), int(rng.integers(1, 12))
        assert divide_spans(list(spans), n, parts) == stock_divide_spans(list(spans), n, parts), (spans, parts)
