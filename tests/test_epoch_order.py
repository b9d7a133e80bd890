"""The order's replacements of streaming's (tokstream/reader/order/py1e.py, sampling.py) and the door's epoch_order.py
against the streaming and numpy functions it stands in for: equal results.

These replacements decide which samples an epoch holds and in which order, so "equal" is exact
equality on random inputs, covering each path they take. Single functions are compared with
streaming's originals, kept by streaming_internals.py; a whole epoch's order, which in this process
would run the project's replacements inside streaming's own batching, with streaming as shipped in
a process of its own (tests/stock_streaming.py).
"""

import warnings
from pathlib import Path

import numpy as np
import pytest

from tokstream.reader.order import py1e, sampling
from tokstream.reader.order.py1e import get_shuffle_py1e_fast
from tokstream.reader.order.sampling import get_sampling_vectorized, permutation_tail
from tokstream.reader.streaming_door.epoch_order import generate_work_random
from tokstream.reader.streaming_door.streaming_internals import epoch_order_in_force, generate_work, worker_ids
from tokstream.reader.streaming_door.streaming_internals import World, get_shuffle, stock_get_sampling
from tokstream.reader.streaming_door.streaming_internals import stock_get_shuffle_py1e as get_shuffle_py1e
from stock_streaming import EveryOtherSample, configure, streaming_dataset

from tokstream.reader import streaming_door


@pytest.fixture(autouse=True, scope="module")
def the_projects_epoch_order():
    """In force as in every process that builds a reader (TokenDataset calls install())."""
    streaming_door.install()


def test_the_tail_of_numpys_permutation_drawn_alone_is_numpys():
    rng = np.random.default_rng(0)
    cases = [(1, 1, 5), (2, 1, 0), (2, 2, 3), (3, 3, 9)]
    cases += [(int(n), int(rng.integers(1, n + 1)), int(rng.integers(0, 2**32))) for n in rng.integers(1, 3000, 300)]
    for n, count, seed in cases:
        np.testing.assert_array_equal(permutation_tail(seed, n, count),
                                      np.random.default_rng(seed).permutation(n)[n - count:], err_msg=str((n, count, seed)))


@pytest.mark.parametrize("max_tail", [sampling.MAX_TAIL, 0])  # 0: the whole-permutation path
def test_the_vectorized_sampling_draws_what_streamings_loop_draws(monkeypatch, max_tail):
    """How many samples an epoch draws from each shard when it takes a fraction of a stream (every epoch cut
    to whole steps does), in force in every dataset (streaming_internals.py), against streaming's own."""
    assert epoch_order_in_force(get_sampling_vectorized, get_shuffle_py1e_fast, generate_work_random)
    monkeypatch.setattr(sampling, "MAX_TAIL", max_tail)
    rng = np.random.default_rng(max_tail)
    for case in range(400):
        shards = rng.integers(0 if case % 4 == 0 else 1, 60, rng.integers(1, 12)).astype(np.int64)  # empty shards too
        shards = shards.astype(np.int32) if case % 7 == 0 else shards
        args = (shards, int(rng.integers(0, 4 * shards.sum() + 1)), int(rng.choice([1, 1, 1, 2, 3, 7, 100])),
                int(rng.integers(0, 1000)), int(rng.integers(0, 5)), bool(rng.integers(0, 2)))
        if not shards.sum():
            continue  # stock divides by zero (warning, not raising): the case below
        got, want = get_sampling_vectorized(*args), stock_get_sampling(*args)
        np.testing.assert_array_equal(got, want, err_msg=str(args))
        assert got.dtype == want.dtype, args
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # stock's division by zero
        empty = (np.zeros(3, np.int64), 5, 2, 0, 0, True)
        np.testing.assert_array_equal(get_sampling_vectorized(*empty), stock_get_sampling(*empty))
    with pytest.raises(ValueError, match="must be a non-negative integer"):
        get_sampling_vectorized(shards, -1, 1, 0, 0, True)


def random_shuffle_args(rng):
    shards = rng.integers(1, 3000, rng.integers(1, 40)).astype(np.int64)
    return (shards, int(rng.integers(1, min(9, shards.sum()) + 1)), int(rng.integers(0, 2**31)),
            int(rng.integers(0, 5)), int(rng.choice([1000, 5000, 1 << 18])))


def shuffled_with_warnings(shuffle, args) -> tuple[np.ndarray, int]:
    """The shuffle, and how many times it warned of a block smaller than a shard. Only that warning is counted:
    catch_warnings records every thread's, and a thread an earlier test left in this process may warn meanwhile."""
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        return shuffle(*args), sum("Shuffle block size was smaller" in str(w.message) for w in warned)


@pytest.mark.parametrize("fraction_bits, min_fraction_bits, sort_run, chunk", [
    (py1e.MAX_FRACTION_BITS, py1e.MIN_FRACTION_BITS, py1e.SORT_RUN, py1e.CHUNK),
    (py1e.MAX_FRACTION_BITS, py1e.MIN_FRACTION_BITS, 1, py1e.CHUNK),  # a run a span, merged
    (2, 0, 5000, 7), (0, 0, 1, 3),  # equal keys in most runs, across runs and across chunks of the equal-keys pass
    (3, 4, 1, py1e.CHUNK)])  # too few bits: the argsort
def test_the_fast_py1e_shuffle_is_streamings_and_is_the_one_in_force(monkeypatch, fraction_bits, min_fraction_bits,
                                                                     sort_run, chunk):
    assert epoch_order_in_force(get_sampling_vectorized, get_shuffle_py1e_fast, generate_work_random)
    monkeypatch.setattr(py1e, "MAX_FRACTION_BITS", fraction_bits)
    monkeypatch.setattr(py1e, "MIN_FRACTION_BITS", min_fraction_bits)
    monkeypatch.setattr(py1e, "SORT_RUN", sort_run)
    monkeypatch.setattr(py1e, "CHUNK", chunk)
    rng = np.random.default_rng(fraction_bits)
    for _ in range(60 if min_fraction_bits <= fraction_bits else 10):
        args = random_shuffle_args(rng)
        expected, stock_warnings = shuffled_with_warnings(get_shuffle_py1e, args)
        got, fast_warnings = shuffled_with_warnings(lambda *a: get_shuffle("py1e", *a), args)
        np.testing.assert_array_equal(got, expected, err_msg=str(args))
        assert got.dtype == expected.dtype and fast_warnings == stock_warnings
    with pytest.raises(ValueError, match="canonical node is 0"):
        get_shuffle_py1e_fast(np.array([1], dtype=np.int64), 2, 0, 0)


@pytest.mark.parametrize("chunk", [py1e.CHUNK, 1, 2, 3])
def test_samples_at_exactly_equal_positions_take_the_order_of_stocks_own_argsort(monkeypatch, chunk):
    """Two equal float positions: stock's unstable argsort decides their order, so the fast shuffle
    recognises them and hands the epoch to that argsort; unequal ones in a run of equal keys it orders."""
    monkeypatch.setattr(py1e, "CHUNK", chunk)
    id_bits, positions = 3, np.array([0.5, 2.25, 2.0, 2.75, 7.0, 2.25])  # by sample id
    keys = np.sort([(int(p) << id_bits) | i for i, p in enumerate(positions)])  # whole positions only
    assert not py1e.order_equal_keys(keys.copy(), positions, id_bits)  # ids 1 and 5 are at 2.25
    positions[5] = 2.5
    assert py1e.order_equal_keys(keys, positions, id_bits)
    assert (keys & 7).tolist() == [0, 2, 1, 5, 3, 4]

    monkeypatch.setattr(py1e, "order_equal_keys", lambda *_: False)  # as if every epoch had such a pair
    rng = np.random.default_rng(7)
    for _ in range(20):
        args = random_shuffle_args(rng)
        expected, stock_warnings = shuffled_with_warnings(get_shuffle_py1e, args)
        got, fast_warnings = shuffled_with_warnings(get_shuffle_py1e_fast, args)
        np.testing.assert_array_equal(got, expected, err_msg=str(args))
        assert fast_warnings == stock_warnings


@pytest.fixture(scope="module")
def mds_streams(tmp_path_factory) -> list[str]:
    """Three small datasets of uneven shards: all an epoch's order sees of a dataset is its shard sizes."""
    from streaming import MDSWriter

    roots = []
    for index, count in enumerate((230, 97, 411)):
        root = tmp_path_factory.mktemp(f"stream{index}")
        with MDSWriter(out=str(root), columns={"x": "int"}, size_limit=200 + 150 * index) as out:
            for value in range(count):
                out.write({"x": value})
        roots.append(str(root))
    return roots


@pytest.mark.parametrize("chunk", [py1e.CHUNK, 97])  # 97: the lookups in many chunks, on threads
def test_the_lean_random_batching_is_streamings_and_is_the_one_in_force(mds_streams, stock, monkeypatch, chunk,
                                                                      tmp_path):
    """The whole epoch's order as the local leader computes it (nodes, ranks, workers, batches), for mixtures
    weighted each way, every shuffle algorithm and none, resumed anywhere, on several nodes; and each worker's part
    of it read from the epoch's order file (order_files.py), built once per epoch and settings and mapped."""
    assert epoch_order_in_force(get_sampling_vectorized, get_shuffle_py1e_fast, generate_work_random)
    monkeypatch.setattr(py1e, "CHUNK", chunk)
    mixtures = [dict(local=mds_streams[2]),
                dict(streams=[dict(local=root, proportion=p) for root, p in zip(mds_streams, (0.5, 0.2, 0.3))],
                     epoch_size=901),
                dict(streams=[dict(local=mds_streams[0], repeat=2.5), dict(local=mds_streams[1], repeat=0.4)]),
                dict(streams=[dict(local=mds_streams[1], choose=50), dict(local=mds_streams[2], choose=411)])]
    rng = np.random.default_rng(11)
    for mixture in mixtures:
        spec = dict(mixture, batch_size=4)
        dataset = streaming_dataset(spec)
        cases = []
        for _ in range(40):
            nodes = int(rng.choice([1, 1, 2, 4]))
            settings = dict(num_canonical_nodes=nodes * int(rng.choice([1, 2, 8])) if rng.integers(2) else max(1, nodes // 2),
                            initial_physical_nodes=None if rng.integers(2) else int(rng.choice([1, 2, 4])),
                            shuffle=bool(rng.integers(4)),
                            shuffle_algo=str(rng.choice(["py1e", "py1e", "py1s", "py1br", "py2s", "naive"])),
                            shuffle_seed=int(rng.integers(0, 10**6)), shuffle_block_size=int(rng.choice([7, 60, 1 << 18])),
                            batch_size=int(rng.integers(1, 9)), sampling_method=str(rng.choice(["balanced", "fixed"])))
            world = [nodes, int(rng.integers(1, 5)), int(rng.integers(1, 4)), 0]
            cases.append(dict(settings=settings, world=world, epoch=int(rng.integers(0, 3)),
                              sample_in_epoch=int(rng.integers(0, dataset.epoch_size + 5))))
        resamples = [dict(settings=dict(settings, sampling_method=method), epoch=epoch)
                     for epoch, method in [(0, "balanced"), (1, "balanced"), (2, "fixed")]]
        expected = stock.run("epoch_orders", mds_streams, spec=spec, cases=cases, resamples=resamples)
        refused = 0
        for index, case in enumerate(cases):
            configure(dataset, case["settings"])
            args = (dataset, World(*case["world"]), case["epoch"], case["sample_in_epoch"])
            got, stocks = outcome(lambda *a: generate_work(dataset.batching_method, *a), args), expected[f"work{index}"]
            if stocks.dtype.kind == "U":  # resumed past the end, canonical nodes that do not divide
                assert isinstance(got, str) and got == str(stocks), case
                refused += 1
                continue
            np.testing.assert_array_equal(got, stocks, err_msg=str(mixture) + str(case))
            assert got.dtype == stocks.dtype
            if dataset.shuffle:
                dataset.order_dir = str(tmp_path / "orders")
                nodes, ranks, workers = case["world"][:3]
                each = [(node, rank, worker) for node in range(nodes) for rank in range(ranks) for worker in range(workers)]
                from_file = worker_ids(dataset, nodes, ranks, workers, case["epoch"], case["sample_in_epoch"], each)
                for (node, rank, worker), ids in zip(each, from_file):
                    np.testing.assert_array_equal(ids[:], stocks[node, rank, worker].reshape(-1), err_msg=str(case))
                dataset.order_dir = None
        assert refused < len(cases) // 2  # most cases are orders, compared
        for index, resample in enumerate(resamples):
            configure(dataset, resample["settings"])
            units, shards = sampling.resampled_shards(dataset, resample["epoch"])
            np.testing.assert_array_equal(units, expected[f"units{index}"])
            np.testing.assert_array_equal(sampling.resampled_sample_ids(dataset, resample["epoch"], shards),
                                          expected[f"ids{index}"])
        del dataset


def test_a_subclasss_own_resampling_is_the_one_the_epoch_order_uses(mds_streams, stock):
    """streaming's batching asks the dataset to resample (`resample_streams`); a subclass may do it its own way."""
    spec = dict(local=mds_streams[2], batch_size=4, shuffle=True, num_canonical_nodes=2, shuffle_block_size=60)
    dataset = streaming_dataset(spec, EveryOtherSample)
    cases = [dict(settings={}, world=world, epoch=1, sample_in_epoch=5) for world in ([1, 2, 2, 0], [2, 1, 3, 0])]
    expected = stock.run("epoch_orders", [mds_streams[2]], spec=spec, cases=cases, resamples=[],
                         dataset_class="EveryOtherSample")
    for index, case in enumerate(cases):
        stocks = expected[f"work{index}"]
        np.testing.assert_array_equal(generate_work(dataset.batching_method, dataset, World(*case["world"]),
                                                    case["epoch"], case["sample_in_epoch"]), stocks)
        assert set(stocks[stocks >= 0].ravel() % 2) == {0}
    del dataset


def outcome(work, args) -> np.ndarray | str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # stock's about sizes; the shuffle's are compared above
        try:
            return work(*args)
        except ValueError as refused:
            return repr(refused)


def test_the_lean_spanner_is_streamings_and_is_the_one_datasets_build(mds_streams):
    from streaming import StreamingDataset

    from tokstream.reader.streaming_door.lean_spanner import LeanSpanner
    from tokstream.reader.streaming_door.streaming_internals import Spanner

    rng = np.random.default_rng(5)
    for _ in range(100):
        sizes = rng.integers(0, int(rng.choice([3, 40, 3000])), rng.integers(1, 30)).astype(np.int64)
        if not sizes.sum():
            sizes[-1] = 1
        span_size = int(rng.choice([3, 64, 1 << 10]))
        stock, lean = Spanner(sizes.copy(), span_size), LeanSpanner(sizes.copy(), span_size)
        assert (lean.num_samples, lean.span_size) == (stock.num_samples, stock.span_size)
        np.testing.assert_array_equal(lean.shard_sizes, stock.shard_sizes)
        np.testing.assert_array_equal(lean.shard_bounds, stock.shard_bounds)
        assert len(lean.spans) == len(stock.spans)
        for ours, theirs in zip(lean.spans, stock.spans):
            np.testing.assert_array_equal(ours, theirs)
            assert ours.dtype == theirs.dtype
        samples = range(int(sizes.sum())) if sizes.sum() < 5000 else rng.integers(0, sizes.sum(), 2000).tolist()
        assert [lean[i] for i in samples] == [stock[i] for i in samples]
        for outside in (-1, int(sizes.sum())):
            with pytest.raises(IndexError):
                lean[outside]
    dataset = StreamingDataset(local=mds_streams[1], batch_size=1)
    assert type(dataset.spanner) is LeanSpanner
    del dataset


def test_the_lean_shard_readers_are_streamings_and_are_the_ones_datasets_build(mds_streams, tmp_path):
    """Each shard's reader built from its index entry without deepcopy: the same fields as stock's (for streaming's
    own MDSWriter's shards and the project's), the entry left as it was, and stock's refusals kept."""
    import json

    from streaming import StreamingDataset

    from tokstream.reader.streaming_door.lean_readers import reader_from_json
    from tokstream.reader.streaming_door.streaming_internals import stock_reader_from_json
    from test_training import tiny_splits

    compressed = tiny_splits(tmp_path, 40, 8)
    indexes = [Path(root, "index.json") for root in mds_streams] + [compressed / "train" / "index.json"]
    for index in indexes:
        for entry in json.loads(index.read_text())["shards"]:
            kept = json.dumps(entry)
            ours, theirs = reader_from_json(str(index.parent), None, entry), stock_reader_from_json(str(index.parent),
                                                                                                   None, entry)
            assert type(ours) is type(theirs) and vars(ours) == vars(theirs)
            assert json.dumps(entry) == kept  # the index entry is not changed
    for damage in ({"version": 1}, {"format": "xsv"}):
        entry = {**json.loads(indexes[0].read_text())["shards"][0], **damage}
        with pytest.raises((ValueError, AssertionError, KeyError)) as ours:
            reader_from_json("x", None, entry)
        with pytest.raises(type(ours.value)):
            stock_reader_from_json("x", None, entry)
    dataset = StreamingDataset(local=mds_streams[1], batch_size=1)
    assert [dataset[i]["x"] for i in range(97)] == list(range(97))
    del dataset
