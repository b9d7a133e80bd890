"""The lazy order at the sizes it exists for (issue 51): train splits of 1.0e9, 4.2e9 and 1e11 samples, ids past 2^32,
with and without a partial repeat and in a mixture, on index-only datasets (a real index and metadata, sparse shards
never read: tokstream/testing/index_only.py). What the ledger and every rank compute: each rank's first and last step
of an epoch, a step at 50 % (where a resumed reader starts), the same global batch on any world size, and coverage on
random positions (distinct, in range, from each source in its share)."""

import numpy as np
import pytest
from test_training import tiny_splits

from tokstream.reader import DataConfig, SampleOrder, StreamConfig, open_dataset
from tokstream.reader.order.lazy import NAME, EpochOrder
from tokstream.testing.index_only import index_only

GLOBAL = 1024


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    return tiny_splits(tmp_path_factory.mktemp("template"), 90, 8)


def spread(samples: int, shards: int) -> list[int]:
    return [samples // shards + (i < samples % shards) for i in range(shards)]


def check_order(order: SampleOrder, streams: list[tuple[int, int]], shares: list[float]) -> None:
    """Every rank's first and last step of epochs 0 and 1 and a step at 50 %, on 2 nodes x 4 ranks, against 1 rank."""
    steps = order.epoch_size // GLOBAL
    assert order.epoch_size == steps * GLOBAL
    for step in (0, steps // 2, steps - 1, steps, 2 * steps - 1):
        wide = order.steps(step, 1, 2, 4)[0]  # (8 ranks, 128)
        one = order.steps(step, 1)[0, 0]
        assert wide.shape == (8, GLOBAL // 8)
        assert sorted(wide.reshape(-1).tolist()) == sorted(one.tolist()), step
        assert len(set(one.tolist())) == GLOBAL and one.min() >= 0 and one.max() < streams[-1][1], step
    # Coverage on random positions of epoch 0: no sample twice, each source in its share.
    dataset = order._loader.dataset
    epoch = EpochOrder(dataset.samples_per_shard, list(dataset.shards_per_stream), [s.choose for s in dataset.streams],
                       dataset.shuffle_seed, 0, dataset.num_canonical_nodes, dataset.shuffle_block_size)
    assert epoch.epoch_size == order.epoch_size
    positions = np.random.default_rng(0).choice(order.epoch_size, 300_000, replace=False)
    ids = epoch.at(positions)
    assert len(np.unique(ids)) == len(ids)
    for (first, end), share in zip(streams, shares):
        inside = ((ids >= first) & (ids < end)).mean()
        assert inside == pytest.approx(share, abs=0.005)
    # The draw gives each source exactly its count, and no shard more than it holds.
    chooses = [s.choose for s in dataset.streams]
    bounds = np.cumsum([0, *dataset.shards_per_stream])
    for stream, choose in enumerate(chooses):
        in_stream = (epoch.unit_shards >= bounds[stream]) & (epoch.unit_shards < bounds[stream + 1])
        assert int(epoch.unit_sizes[in_stream].sum()) == choose
    assert (epoch.unit_sizes <= dataset.samples_per_shard[epoch.unit_shards]).all()


@pytest.mark.parametrize("samples, shards", [(1_000_000_006, 40), (4_200_000_000, 20), (100_000_000_000, 300),
                                             (100_000_000_007, 300)])
def test_one_dataset_of_a_billion_to_a_hundred_billion_samples(template, tmp_path, samples, shards):
    root = index_only(template, tmp_path / "ds", spread(samples, shards))
    order = SampleOrder(open_dataset(DataConfig(remote=str(root), num_canonical_nodes=8)), GLOBAL)
    try:
        assert order._loader.dataset.shuffle_algo == NAME  # auto's choice at this size
        partial = order.epoch_size < samples  # cut to whole steps: the last repeat is a draw
        assert partial == (samples % GLOBAL != 0)
        check_order(order, [(0, samples)], [1.0])
    finally:
        order.close()


def test_a_mixture_past_two_to_the_32(template, tmp_path):
    web = index_only(template, tmp_path / "web", spread(3_000_000_000, 12))
    books = index_only(template, tmp_path / "books", spread(1_300_000_001, 7))
    config = DataConfig(streams=[StreamConfig(remote=str(web), name="web", proportion=0.6),
                                 StreamConfig(remote=str(books), name="books", proportion=0.4)],
                        num_canonical_nodes=8)
    order = SampleOrder(open_dataset(config), GLOBAL)
    try:
        check_order(order, [(0, 3_000_000_000), (3_000_000_000, 4_300_000_001)], [0.6, 0.4])
    finally:
        order.close()
