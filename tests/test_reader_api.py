"""The public reader API (tokstream.reader) as a loop of one's own uses it, in one process: the samples of a
mixture with their sources, a resume from state_dict() between any two micro-batches, and close()."""

import multiprocessing

import pytest
from conftest import split_samples
from test_training import tiny_splits

from tokstream.reader import BatchPlan, DataConfig, StreamConfig, TrainBatches, open_dataset, to_device


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> DataConfig:
    roots = []
    for index, name in enumerate(("web", "books")):
        folder = tmp_path_factory.mktemp(name)
        roots.append(tiny_splits(folder, 40 + 8 * index, 8, seed=index))
    return DataConfig(streams=[StreamConfig(remote=str(roots[0]), name="web"),
                               StreamConfig(remote=str(roots[1]), name="books")])


def test_every_sample_of_an_epoch_once_with_its_tokens_and_its_source(mixture):
    dataset = open_dataset(mixture)
    plan = BatchPlan(global_batch_size=8, micro_batch_size=4, world_size=1)
    batches = TrainBatches(dataset, plan, with_sources=True)
    assert batches.epoch_samples == [40, 48] and dataset.source_names == ["web", "books"]
    stored = [split_samples(source.remote) for source in dataset.sources]  # the shards' samples, as converted
    seen = []
    for _ in range(88 // 4):
        batch = next(batches)
        assert batch["tokens"].shape == (4, 65)
        for tokens, sample_id, source in zip(batch["tokens"], batch["ids"].tolist(), batch["source"].tolist()):
            assert source == (0 if sample_id < 40 else 1)
            assert tokens.tolist() == stored[source][sample_id - 40 * source].tolist()
            seen.append(sample_id)
    assert sorted(seen) == list(range(88))
    inputs, targets = to_device(batch, "cpu")
    assert inputs.dtype == targets.dtype == pytest.importorskip("torch").int64
    assert (inputs[:, 1:] == targets[:, :-1]).all()
    batches.close()


@pytest.mark.parametrize("taken", [0, 3, 21, 25])  # none, part of an epoch, its last micro-batch, into the next
def test_a_state_taken_between_micro_batches_resumes_with_the_next_one(mixture, taken):
    dataset, plan = open_dataset(mixture), BatchPlan(8, 4, 1)
    whole = TrainBatches(dataset, plan)
    expected = [next(whole)["ids"].tolist() for _ in range(taken + 6)]
    first = TrainBatches(dataset, plan)
    for _ in range(taken):
        next(first)
    state = first.state_dict()
    first.close()
    resumed = TrainBatches(dataset, plan)
    resumed.load_state_dict(state)
    assert [next(resumed)["ids"].tolist() for _ in range(6)] == expected[taken:]
    whole.close()
    resumed.close()


def test_close_ends_the_dataloader_workers(mixture):
    dataset = open_dataset(DataConfig(streams=mixture.streams, num_workers=2))
    batches = TrainBatches(dataset, BatchPlan(8, 4, 1))
    next(batches)
    assert len(multiprocessing.active_children()) >= 2
    batches.close()
    assert multiprocessing.active_children() == []
