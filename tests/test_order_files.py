"""Streaming's epoch orders kept as files (data.order_dir, tokstream/reader/streaming_door/order_files.py): a reader
reads the very samples it reads without them, each epoch's file is built once and mapped by every later reader, the
next epoch's is built ahead, a build that died leaves nothing that looks complete, and `auto` keeps a run's order.
That each worker's ids from the file are stock streaming's own is proven in test_epoch_order.py."""

import dataclasses
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from test_training import tiny_splits

from tokstream.errors import UserError
from tokstream.reader import BatchPlan, DataConfig, SampleOrder, StreamConfig, TrainBatches, open_dataset
from tokstream.reader.lazy_shuffle import NAME
from tokstream.reader.streaming_door import order_files


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> DataConfig:
    roots = []
    for index, (name, samples) in enumerate((("web", 90), ("books", 61))):
        roots.append(tiny_splits(tmp_path_factory.mktemp(name), samples, 8, seed=index))
    return DataConfig(streams=[StreamConfig(remote=str(roots[0]), name="web", proportion=0.7),
                               StreamConfig(remote=str(roots[1]), name="books", proportion=0.3)],
                      shuffle_block_size=16, num_canonical_nodes=2)


def read(config: DataConfig, plan: BatchPlan, micro_batches: int, state: dict | None = None) -> tuple[list, dict]:
    batches = TrainBatches(open_dataset(config), plan)
    if state is not None:
        batches.load_state_dict(state)
    ids = [next(batches)["ids"].tolist() for _ in range(micro_batches)]
    state = batches.state_dict()
    batches.close()
    return ids, state


def epoch_files(directory) -> dict[int, str]:
    return {int(name.rsplit("-", 1)[1][:-4]): name for name in os.listdir(directory) if name.endswith(".npy")}


def wait_for(predicate, timeout_s: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_reader_with_order_files_reads_the_samples_it_reads_without_them(mixture, tmp_path):
    """Three epochs of a mixture, in micro-batches of 4 and with DataLoader workers, resumed mid-epoch: the same ids as
    streaming's in-memory order; the files are uint32, one per epoch read."""
    files = dataclasses.replace(mixture, order_dir=str(tmp_path / "orders"))
    epoch = sum(open_dataset(mixture).epoch_samples(BatchPlan(8, 1, 1)))
    steps = 3 * epoch // 4
    stock, _ = read(mixture, BatchPlan(8, 4, 1), steps)
    assert read(files, BatchPlan(8, 4, 1), steps)[0] == stock
    assert read(dataclasses.replace(files, num_workers=2), BatchPlan(8, 4, 1), steps)[0] == stock
    first, state = read(files, BatchPlan(8, 4, 1), epoch // 4 + 3)
    assert first + read(files, BatchPlan(8, 4, 1), steps - len(first), state)[0] == stock
    assert wait_for(lambda: {0, 1, 2, 3} <= set(epoch_files(tmp_path / "orders")))  # 3: built ahead while 2 was read
    for name in epoch_files(tmp_path / "orders").values():
        ids = np.load(tmp_path / "orders" / name, mmap_mode="r")
        assert ids.dtype == np.uint32 and ids.shape == (epoch,)


def test_an_epochs_file_is_built_once_and_mapped_by_every_later_reader_and_the_ledger(mixture, tmp_path):
    directory = tmp_path / "orders"
    files = dataclasses.replace(mixture, order_dir=str(directory))
    read(files, BatchPlan(8, 2, 1), 2)
    assert wait_for(lambda: {0, 1} <= set(epoch_files(directory)))
    before = {name: os.stat(directory / name) for name in os.listdir(directory)}
    ids, _ = read(files, BatchPlan(8, 8, 1), 3)
    order = SampleOrder(open_dataset(files), 8)
    try:
        assert order.steps(0, 3).reshape(3, -1).tolist() == ids
    finally:
        order.close()
    after = {name: os.stat(directory / name) for name in os.listdir(directory)}
    assert {name: (s.st_ino, s.st_mtime_ns) for name, s in after.items()} == \
        {name: (s.st_ino, s.st_mtime_ns) for name, s in before.items()}  # mapped, never written again
    read(dataclasses.replace(files, shuffle_seed=5), BatchPlan(8, 2, 1), 1)
    assert len([n for n in os.listdir(directory) if n.endswith("-epoch-0.npy")]) == 2  # another seed, another file


def test_a_dead_builders_partial_file_is_removed_and_no_other(mixture, tmp_path):
    """A build killed mid-write leaves a partial name; the next build removes it only when its process is provably
    gone (this host, no process with its pid and start time): a live builder's and another host's stay."""
    directory = tmp_path / "orders"
    directory.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    tag = order_files._process_tag(dead.pid)
    dead.kill()
    dead.wait()
    final = "order-0123-epoch-0.npy"
    partials = {"dead": f".{final}.{tag}.partial", "live": f".{final}.{order_files._process_tag(os.getpid())}.partial",
                "reused pid": f".{final}.{socket.gethostname()}.{os.getpid()}.1.partial",
                "other host": f".{final}.elsewhere.{dead.pid}.{tag.rsplit('.', 1)[1]}.partial"}
    for name in partials.values():
        (directory / name).write_bytes(b"\x93NUMPY")
    read(dataclasses.replace(mixture, order_dir=str(directory)), BatchPlan(8, 2, 1), 1)
    left = set(os.listdir(directory))
    assert partials["dead"] not in left and partials["reused pid"] not in left
    assert partials["live"] in left and partials["other host"] in left


def test_a_file_under_an_epochs_name_that_is_not_its_order_is_refused_in_one_line(mixture, tmp_path):
    directory = tmp_path / "orders"
    files = dataclasses.replace(mixture, order_dir=str(directory))
    read(files, BatchPlan(8, 2, 1), 1)
    name = epoch_files(directory)[0]
    np.save(directory / name, np.arange(10, dtype=np.uint32))
    with pytest.raises(UserError, match=f"{name} holds .*not an epoch order of .* remove it"):
        order = SampleOrder(open_dataset(files), 8)
        try:
            order.steps(0, 1)
        finally:
            order.close()


def test_builders_racing_for_one_epoch_build_it_once(mixture, tmp_path):
    """Four processes asked for one epoch's order at once: one builds it, the others wait and map it."""
    batches = TrainBatches(open_dataset(mixture), BatchPlan(8, 8, 1))
    dataset = batches.loader.dataset
    dataset._set_shuffle_block_size(dataset._unique_rank_world)
    inputs = order_files.OrderInputs.of(dataset)
    batches.close()
    code = ("import pickle, sys; from tokstream.reader import streaming_door; streaming_door.install(); "
            "from tokstream.reader.streaming_door import order_files; "
            "inputs, directory = pickle.loads(sys.stdin.buffer.read()); "
            "print(order_files.build(inputs, 4, directory).stat().st_ino)")
    import pickle

    racers = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
              for _ in range(4)]
    for racer in racers:
        racer.stdin.write(pickle.dumps((inputs, str(tmp_path))))
        racer.stdin.close()
    inodes = {racer.stdout.read().strip() for racer in racers}
    assert [racer.wait() for racer in racers] == [0] * 4
    assert len(inodes) == 1 and not [n for n in os.listdir(tmp_path) if n.endswith(".partial")]
    from tokstream.reader.streaming_door.epoch_order import epoch_sequence

    assert np.array_equal(np.load(tmp_path / epoch_files(tmp_path)[4]), epoch_sequence(inputs, 4))


def test_auto_takes_the_lazy_order_from_its_size_and_keeps_the_order_a_state_was_read_in(mixture, tmp_path):
    """`auto` (the default): py1e below data.lazy_order_from samples, the lazy order from there; a state read in
    another order (py1e, or an older state that does not say: py1e, the default then) resumes in its own."""
    assert DataConfig().shuffle_algo == "auto"
    small = dataclasses.replace(mixture, order_dir=str(tmp_path / "orders"))
    large = dataclasses.replace(small, lazy_order_from=151)  # the mixture's sources hold 90 + 61 samples
    assert open_dataset(small).config.shuffle_algo == "py1e"
    assert open_dataset(large).config.shuffle_algo == NAME
    assert open_dataset(dataclasses.replace(large, lazy_order_from=152)).config.shuffle_algo == "py1e"
    named = dataclasses.replace(small, shuffle_algo="py1e")
    whole, _ = read(named, BatchPlan(8, 4, 1), 30)
    first, state = read(named, BatchPlan(8, 4, 1), 11)
    assert state["shuffle_algo"] == "py1e"
    assert first + read(large, BatchPlan(8, 4, 1), 19, state)[0] == whole
    older = {key: value for key, value in state.items() if key in ("dataset_identity", "global_batch_size", "position")}
    assert first + read(large, BatchPlan(8, 4, 1), 19, older)[0] == whole
    lazy, _ = read(large, BatchPlan(8, 4, 1), 30)
    assert lazy != whole
    first, state = read(large, BatchPlan(8, 4, 1), 11)
    assert state["shuffle_algo"] == NAME and first + read(small, BatchPlan(8, 4, 1), 19, state)[0] == lazy
