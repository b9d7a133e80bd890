"""The lazy order (data.shuffle_algo: lazy) end to end: what a worker reads is its part of the epoch's
order (tokstream/reader/order/lazy.py), every step's global batch is the same on any world size, micro-batch and
worker count, an epoch holds each source's count, and a reader resumed mid-epoch goes on with the very samples."""

import numpy as np
import pytest
from test_training import tiny_splits

from tokstream.reader import BatchPlan, DataConfig, SampleOrder, StreamConfig, TrainBatches, open_dataset
from tokstream.reader.order.feistel_window import FeistelWindowOrder
from tokstream.reader.order.lazy import NAME, EpochOrder


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> DataConfig:
    roots = []
    for index, (name, samples) in enumerate((("web", 90), ("books", 61))):
        roots.append(tiny_splits(tmp_path_factory.mktemp(name), samples, 8, seed=index))
    return DataConfig(streams=[StreamConfig(remote=str(roots[0]), name="web", proportion=0.7),
                               StreamConfig(remote=str(roots[1]), name="books", proportion=0.3)],
                      shuffle_algo=NAME, shuffle_block_size=16)


def read(config: DataConfig, plan: BatchPlan, micro_batches: int, state: dict | None = None) -> tuple[list, dict]:
    batches = TrainBatches(open_dataset(config), plan)
    if state is not None:
        batches.load_state_dict(state)
    ids = [next(batches)["ids"].tolist() for _ in range(micro_batches)]
    state = batches.state_dict()
    batches.close()
    return ids, state


def test_an_epoch_of_the_lazy_order_holds_each_sources_count_once_each_and_differs_by_epoch():
    sizes, streams, chooses = np.array([30, 0, 25, 40, 17]), [3, 2], [100, 20]  # a source repeated, one drawn from
    for epoch in range(3):
        order = EpochOrder(sizes, streams, chooses, 9176, epoch, 2, 16)
        ids = order.at(np.arange(order.epoch_size))
        assert order.epoch_size == 120
        first = ids[ids < 55]
        assert len(first) == 100 and np.bincount(first, minlength=55).min() >= 1  # 55 samples, 100 drawn: 1 or 2 each
        second = ids[ids >= 55]
        assert len(second) == 20 and len(set(second.tolist())) == 20 and second.max() < 112  # 20 of 57, no repeat
    other = EpochOrder(sizes, streams, chooses, 9176, 1, 2, 16).at(np.arange(120))
    assert not np.array_equal(ids, other)


def test_every_global_batch_is_the_same_on_any_world_size_micro_batch_and_workers(mixture):
    """One rank reading micro-batches of 4 is the reference; SampleOrder deals the same global batches to 2 and 4
    ranks and to 2 nodes x 2 ranks (the ledger's path), and DataLoader workers read the same."""
    dataset = open_dataset(mixture)
    epoch = sum(dataset.epoch_samples(BatchPlan(8, 1, 1)))
    whole, _ = read(mixture, BatchPlan(8, 4, 1), 2 * epoch // 4 + 4)  # two epochs and a step
    steps = [sorted(sum(whole[at:at + 2], [])) for at in range(0, len(whole) - 1, 2)]
    order = SampleOrder(dataset, 8)
    try:
        for nodes, per_node in ((1, 1), (1, 2), (1, 4), (2, 2)):
            dealt = order.steps(0, len(steps), nodes, per_node)
            assert [sorted(step.reshape(-1).tolist()) for step in dealt] == steps, (nodes, per_node)
    finally:
        order.close()
    import dataclasses

    workers, _ = read(dataclasses.replace(mixture, num_workers=2), BatchPlan(8, 4, 1), len(whole))
    assert workers == whole


def test_a_reader_resumed_mid_epoch_and_at_an_epoch_end_goes_on_with_the_same_samples(mixture):
    dataset = open_dataset(mixture)
    epoch = sum(dataset.epoch_samples(BatchPlan(8, 1, 1)))
    whole, _ = read(mixture, BatchPlan(8, 2, 1), epoch // 2 + 12)
    for taken in (3, 8, epoch // 2, epoch // 2 + 4):
        first, state = read(mixture, BatchPlan(8, 2, 1), taken)
        rest, _ = read(mixture, BatchPlan(8, 2, 1), len(whole) - taken, state)
        assert first + rest == whole, taken


def test_one_rank_reads_the_epochs_lazy_order_itself_not_stocks_resampling(mixture):
    """One rank, one worker: the partition is the order itself, so the reader's ids are EpochOrder's, position by
    position (stock's resampling would draw other samples of the sources it draws from)."""
    batches = TrainBatches(open_dataset(mixture), BatchPlan(8, 8, 1))
    stock = batches.loader.dataset
    epoch = sum(batches.epoch_samples)
    ids = np.concatenate([next(batches)["ids"].numpy() for _ in range(epoch // 8)])
    order = EpochOrder(stock.samples_per_shard, list(stock.shards_per_stream), [s.choose for s in stock.streams],
                           stock.shuffle_seed, 0, stock.num_canonical_nodes, stock.shuffle_block_size)
    assert ids.tolist() == order.at(np.arange(epoch)).tolist()
    batches.close()


def test_training_in_the_lazy_order_resumes_exactly_after_sigterm_sigkill_and_on_another_world_size(dataset, tmp_path):
    """On the plays (several shards, an epoch cut to whole steps, so the lazy resampling draws): SIGTERM after a
    checkpoint on 2 ranks, a relaunch on 1 rank SIGKILLed, and a last one on 2 ranks, against an uninterrupted 2-rank
    run: every step's global batch and learning rate, and the losses bitwise until the world size changes (float
    rounding after it). What is tested is the order's resumption: the ranks are warm forks (tests/warm_ranks.py),
    signalled as torchrun's agent forwards a signal; they share the test process's resource tracker (a real rank's
    own tracker would unlink the killed rank's shared memory when it dies: here it is left). torchrun's own part
    (its agent's forwarding and death, its restarts) is tested in test_training.py and test_nothing_lost.py."""
    import signal

    from test_training import finish, launch, metrics, train, wait_for

    from tokstream.train.checkpoint_files import latest_step
    from tokstream.train.run_store import LocalRunStore

    lazy = ["data.shuffle_algo=lazy", "data.shuffle_block_size=64"]
    train(2, dataset, tmp_path / "reference", *lazy)
    reference = metrics(tmp_path / "reference")
    run_dir, store = tmp_path / "interrupted", LocalRunStore(str(tmp_path / "interrupted"))

    first = launch(2, dataset, run_dir, *lazy, warm=True)
    wait_for(lambda: (latest_step(store) or 0) >= 4 and len(metrics(run_dir)) >= 5)
    first.send_signal(signal.SIGTERM)
    first.communicate(timeout=120)
    assert first.returncode == 75  # preempted, not ended
    stopped = latest_step(store)
    assert stopped <= 12, f"the SIGTERM landed at step {stopped}: too late to leave the relaunch steps to be killed in"
    second = launch(1, dataset, run_dir, *lazy, "checkpoint_interval=1", warm=True)
    wait_for(lambda: (latest_step(store) or 0) > stopped)  # its first checkpoint: steps to spare before its end
    second.kill_tree()
    second.communicate(timeout=60)
    assert second.returncode == -signal.SIGKILL, "the relaunch ended before the kill: the kill was not tested"
    finish(launch(2, dataset, run_dir, *lazy, warm=True))

    interrupted = metrics(run_dir)
    assert [m["step"] for m in interrupted] == [m["step"] for m in reference] == list(range(1, 17))
    for got, want in zip(interrupted, reference):
        assert sorted(sum(got["samples"], [])) == sorted(sum(want["samples"], [])) and got["lr"] == want["lr"], got["step"]
        if got["step"] <= stopped:
            assert got["samples"] == want["samples"] and got["loss"] == want["loss"], got["step"]
        else:
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-3), got["step"]


def test_the_first_lazy_order_is_the_one_runs_were_trained_in():
    """Pinned values of feistel_window, kept for the runs read in it: a run's checkpoints resume in the order they were trained in only if the lazy order never
    changes from one version of the project to the next (a faster computation must give the very same ids). A
    mixture with an empty shard in each source, one source whole and one repeated and drawn from, 3 canonical nodes,
    windows of 16."""
    import hashlib

    sizes = np.array([5, 0, 17, 9, 33, 1, 12, 40, 8, 0, 21])
    pinned = {0: ([74, 78, 73, 70, 69, 65, 77, 66, 71, 80, 68, 72], "5792bcc768025f593842cd697517d669"),
              1: ([73, 69, 0, 70, 72, 3, 66, 1, 75, 65, 74, 67], "b08088e9a0f75e5a98a537972284b365")}
    for epoch, (first, digest) in pinned.items():
        order = FeistelWindowOrder(sizes, [7, 4], [None, 150], seed=1234, epoch=epoch, num_canonical_nodes=3,
                               block_size=16)
        ids = order.at(np.arange(order.epoch_size))
        assert order.epoch_size == 227 and ids[:12].tolist() == first
        assert hashlib.sha256(ids.astype("<i8").tobytes()).hexdigest()[:32] == digest


def test_a_reader_state_made_before_the_lazy_order_changed_resumes_in_the_order_it_was_read_in(tmp_path):
    """tests/states_from_before/lazy_order_v1.json was written by the code of stop 49, when `auto` chose feistel_window
    at this size: a reader state after 7 micro-batches, and the 40 micro-batches read after it (three epochs, partial
    repeats drawn). Today `auto` chooses the lazy order; a reader loading that state reads in feistel_window, sample
    for sample as it then did, and says so in its own state. A fresh reader reads in the lazy order."""
    import json
    from pathlib import Path

    recorded = json.loads((Path(__file__).parent / "states_from_before" / "lazy_order_v1.json").read_text())
    (tmp_path / "web").mkdir()
    (tmp_path / "books").mkdir()
    web = tiny_splits(tmp_path / "web", 90, 8, seed=0)
    books = tiny_splits(tmp_path / "books", 61, 8, seed=1)
    configs = {"single": DataConfig(remote=str(web), lazy_order_from=1, shuffle_block_size=16),
               "mixture": DataConfig(streams=[StreamConfig(remote=str(web), name="web", proportion=0.7),
                                              StreamConfig(remote=str(books), name="books", proportion=0.3)],
                                     lazy_order_from=1, shuffle_block_size=16)}
    for name, config in configs.items():
        state = recorded[name]["state"]
        assert state["shuffle_algo"] == "feistel_window"
        # The same samples, but the identity hashes metadata.json, which names the token files' folder (another here).
        fresh = TrainBatches(open_dataset(config), BatchPlan(8, 4, 1))
        state["dataset_identity"] = fresh.state_dict()["dataset_identity"]
        fresh.close()
        after, resumed = read(config, BatchPlan(8, 4, 1), len(recorded[name]["after"]), state)
        assert after == recorded[name]["after"], name
        assert resumed["shuffle_algo"] == "feistel_window"
        fresh = TrainBatches(open_dataset(config), BatchPlan(8, 4, 1))
        assert fresh.state_dict()["shuffle_algo"] == NAME
        fresh.close()
