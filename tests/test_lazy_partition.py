"""tokstream/reader/order/partition.py against stock streaming's own `get_partitions("orig", ...)`: the same ids at
every node, rank, worker and position, on thousands of configurations (samples, canonical and physical nodes,
ranks, workers, batch sizes, samples dropped), the configurations stock refuses refused too."""

import itertools
import warnings

import numpy as np
import pytest

from tokstream.reader.order.partition import Partition
from tokstream.reader.streaming_door.streaming_internals import get_partitions  # stock streaming's own


def stock(*args) -> np.ndarray | type:
    """Stock's array, or the type of error it raises."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # stock warns of repeats when there are few samples
        try:
            return get_partitions("orig", *args)
        except ValueError:
            return ValueError


def lazy(*args) -> np.ndarray | type:
    try:
        return Partition(*args).full()
    except ValueError:
        return ValueError


def configurations(rng: np.random.Generator, count: int):
    """Random layouts where canonical and physical nodes divide each other (and some where they do not)."""
    for _ in range(count):
        physical = int(rng.choice([1, 2, 3, 4, 6, 8]))
        canonical = int(rng.choice([physical * k for k in (1, 2, 3, 4)] + [d for d in range(1, 9) if physical % d == 0]
                                   + [5, 7]))
        samples = int(rng.integers(1, 400)) if rng.random() < 0.9 else int(rng.integers(1, 12))
        ranks, workers, batch = int(rng.integers(1, 9)), int(rng.integers(1, 5)), int(rng.integers(1, 7))
        world = ranks * physical
        drop = int(rng.integers(0, samples + world - samples % world + 2))
        yield samples, canonical, physical, ranks, workers, batch, drop


@pytest.mark.parametrize("seed", range(4))
def test_every_id_is_stocks_on_random_layouts(seed):
    for args in configurations(np.random.default_rng(seed), 1000):
        expected, got = stock(*args), lazy(*args)
        if expected is ValueError or got is ValueError:
            assert got is expected, args
        else:
            assert got.shape == expected.shape and np.array_equal(got, expected), args


def test_every_small_layout_exhaustively():
    """Every combination of small sizes, where the edge cases live: rows shorter than others, padding of canonical
    rows and of ranks, fewer samples than nodes or ranks, everything dropped."""
    for samples, canonical, physical, ranks, workers, batch in itertools.product(
            range(1, 14), (1, 2, 3, 4, 6, 8), (1, 2, 4), (1, 2, 3), (1, 2), (1, 3)):
        for drop in (0, 1, samples // 2, samples, samples + 3):
            args = (samples, canonical, physical, ranks, workers, batch, drop)
            expected, got = stock(*args), lazy(*args)
            if expected is ValueError or got is ValueError:
                assert got is expected, args
            else:
                assert np.array_equal(got, expected), args


def test_a_ranks_ids_are_computed_without_the_epoch():
    """880 M samples over 8 canonical nodes, 2 nodes x 8 ranks x 2 workers: a rank's ids at any position cost what
    they cost at any size; checked against a smaller layout of the same shape computed by stock."""
    huge = Partition(880_000_000, 8, 2, 8, 2, 12, drop_first=440_000_016)
    positions = np.array([0, 1, 11, 12, 5_000_000, huge.batches_per_worker * 12 - 1])
    ids = huge.ids(1, 7, 1, positions)
    assert ids.shape == (6,) and ids.min() >= -1 and ids.max() < 880_000_000
    small = (8_800, 8, 2, 8, 2, 12, 4_416)
    assert np.array_equal(Partition(*small).full(), stock(*small))


def test_the_relaxed_partition_after_a_change_of_nodes_is_stocks():
    """`relaxed` (streaming's default) deals the initial nodes' orig partition out to today's nodes at the same global
    batch when the node counts no longer divide each other; otherwise it is orig."""
    from tokstream.reader.order.partition import RelaxedPartition

    rng = np.random.default_rng(7)
    checked = dealt_again = 0
    for _ in range(3000):
        canonical, initial, physical = (int(rng.choice([1, 2, 3, 4, 6, 8])) for _ in range(3))
        ranks, workers, batch = int(rng.integers(1, 5)), int(rng.integers(1, 4)), int(rng.integers(1, 7))
        samples = int(rng.integers(1, 300))
        drop = int(rng.integers(0, samples + 1))
        args = (samples, canonical, physical, ranks, workers, batch, drop, initial)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                expected = get_partitions("relaxed", *args)
            except ValueError:
                expected = ValueError
        try:
            got = RelaxedPartition(*args).full()
        except ValueError:
            got = ValueError
        if expected is ValueError or got is ValueError:
            assert got is expected, args
        else:
            assert np.array_equal(got, expected), args
            checked += 1
            dealt_again += RelaxedPartition(*args).initial.num_physical_nodes != physical
    assert checked > 1000 and dealt_again > 100  # both of relaxed's branches
