"""Streaming's epoch orders kept as files (data.order_dir, tokstream/reader/order/order_files.py): a reader
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
from conftest import ROOT, run_script
from test_lazy_order import read
from test_training import tiny_splits
from warm_ranks import WarmPython, run_warm

from tokstream.reader import BatchPlan, DataConfig, SampleOrder, StreamConfig, TrainBatches, open_dataset
from tokstream.reader.order.lazy import NAME
from tokstream.reader.order import order_files
from tokstream.reader.streaming_door.streaming_internals import order_inputs


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> DataConfig:
    roots = []
    for index, (name, samples) in enumerate((("web", 90), ("books", 61))):
        roots.append(tiny_splits(tmp_path_factory.mktemp(name), samples, 8, seed=index))
    return DataConfig(streams=[StreamConfig(remote=str(roots[0]), name="web", proportion=0.7),
                               StreamConfig(remote=str(roots[1]), name="books", proportion=0.3)],
                      shuffle_block_size=16, num_canonical_nodes=2)


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


def test_mixtures_of_the_same_datasets_at_other_weights_share_an_order_dir_and_each_reads_its_own(mixture, tmp_path):
    """The same two datasets at other proportions (two phases of one run do this), one order_dir: each epoch file is
    its own mixture's, and each reads what its in-memory order gives, whichever built first."""
    other = dataclasses.replace(mixture, streams=[dataclasses.replace(mixture.streams[0], proportion=0.4),
                                                  dataclasses.replace(mixture.streams[1], proportion=0.6)])
    plan, shared = BatchPlan(8, 4, 1), str(tmp_path / "orders")
    assert sum(open_dataset(other).epoch_samples(plan)) == sum(open_dataset(mixture).epoch_samples(plan))
    in_memory = {id(config): read(config, plan, 12)[0] for config in (mixture, other)}
    assert in_memory[id(mixture)] != in_memory[id(other)]
    for config in (mixture, other, mixture):
        assert read(dataclasses.replace(config, order_dir=shared), plan, 12)[0] == in_memory[id(config)]


def test_every_setting_an_epochs_order_depends_on_names_its_file(mixture):
    """Runs sharing an order_dir read one file only when every setting their order depends on is the same: each
    setting an order file's inputs hold, changed alone, gives another order of the epoch and another file name (one
    left out of the name, a run would silently read another's order: a seed, a block size, the canonical nodes)."""
    order = SampleOrder(open_dataset(mixture), 8)
    try:
        inputs = order_inputs(order._loader.dataset)  # with the door's computation of an order
    finally:
        order.close()
    inputs = dataclasses.replace(inputs, samples_per_shard=np.array([30, 20, 25, 26, 40]), shards_per_stream=[3, 2],
                                 chooses=[70, 40])
    changes = {"samples_per_shard": np.array([30, 25, 20, 26, 40]), "shards_per_stream": [2, 3], "chooses": [71, 39],
               "sampling_method": "fixed", "sampling_granularity": 4, "epoch_seed_change": False, "shuffle": False,
               "shuffle_algo": "py1s", "shuffle_seed": 9177, "num_canonical_nodes": 3, "shuffle_block_size": 17}
    assert set(changes) == {f.name for f in dataclasses.fields(inputs) if f.init and f.compare}  # a new one too
    epoch = inputs.compute(inputs, 1)
    for name, value in changes.items():
        other = dataclasses.replace(inputs, **{name: value})
        assert not np.array_equal(other.compute(other, 1), epoch), name
        assert order_files.order_path(other, 1, "orders") != order_files.order_path(inputs, 1, "orders"), name


def test_the_next_epoch_is_built_ahead_for_a_reader_started_from_anywhere(mixture, tmp_path):
    """As train/main.py runs: in another folder, the repository on the process's own path alone (not PYTHONPATH).
    Here the process imports from the repository's folder, then moves to another before it reads."""
    files = dataclasses.replace(mixture, order_dir=str(tmp_path / "orders"))
    code = (f"import os; from tokstream.reader import *; from tokstream.reader import StreamConfig; "
            f"os.chdir({str(tmp_path)!r}); b = TrainBatches(open_dataset({files!r}), BatchPlan(8, 4, 1)); "
            "next(b); b.close()")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr
    assert wait_for(lambda: {0, 1} <= set(epoch_files(tmp_path / "orders")))


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


@pytest.mark.parametrize("algo", ["py1e", "py1s"])
def test_the_builder_ahead_imports_streaming_only_off_py1e_and_builds_the_order_readers_read(mixture, tmp_path, algo):
    """build_ahead starts a process at every epoch of every launch (`python -m ...order_files`, the inputs pickled on
    its stdin). In py1e, what `auto` takes for data that fits, it imports neither streaming nor torch (3 s and
    ~300 MB each time); in another of streaming's shuffles it needs streaming's. Its file holds the epoch's order as a
    reader computes it in memory."""
    import pickle

    from tokstream.reader.streaming_door.epoch_order import epoch_sequence

    files = dataclasses.replace(mixture, order_dir=str(tmp_path / "orders"), shuffle_algo=algo)
    order = SampleOrder(open_dataset(files), 8)
    try:
        dataset = order._loader.dataset
        inputs = order_inputs(dataset)
        in_memory = epoch_sequence(dataset, 3)
    finally:
        order.close()
    code = ("import runpy, sys; runpy.run_module('tokstream.reader.order.order_files', run_name='__main__'); "
            "print(sorted(name for name in ('streaming', 'torch') if name in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], input=pickle.dumps((inputs, 3, str(tmp_path / "orders"))),
                          capture_output=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert done.stdout.decode().split("\n")[0] == ("[]" if algo == "py1e" else "['streaming', 'torch']")
    built = np.load(tmp_path / "orders" / epoch_files(tmp_path / "orders")[3])
    assert built.dtype == np.uint32 and built.tolist() == in_memory.tolist()


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
    start = tag.rsplit("@", 1)[1]
    partials = {"dead": f".{final}@{tag}.partial", "live": f".{final}@{order_files._process_tag(os.getpid())}.partial",
                "reused pid": f".{final}@{socket.gethostname()}@{os.getpid()}@1.partial",
                "other host": f".{final}@gpu17.cluster.{socket.gethostname()}@{dead.pid}@{start}.partial",
                "other host, dotted": f".{final}@{socket.gethostname()}.cluster.local@{dead.pid}@{start}.partial"}
    for name in partials.values():
        (directory / name).write_bytes(b"\x93NUMPY")
    read(dataclasses.replace(mixture, order_dir=str(directory)), BatchPlan(8, 2, 1), 1)
    left = set(os.listdir(directory))
    assert partials["dead"] not in left and partials["reused pid"] not in left
    assert partials["live"] in left and partials["other host"] in left and partials["other host, dotted"] in left


def damage(path, how: str) -> None:
    """An epoch's file changed as a disk, a hand or another job might: its mapped ids edited in place."""
    ids = np.load(path, mmap_mode="r+")
    if how == "halves swapped":
        half = len(ids) // 2
        ids[:2 * half] = np.concatenate([ids[half:2 * half], ids[:half]])
    elif how == "five ids overwritten":
        ids[3:8] = ids[10:15]
    elif how in ("an id out of range", "an id out of range, checksummed"):
        ids[7] = np.iinfo(ids.dtype).max
    ids.flush()
    if how == "an id out of range, checksummed":  # as a builder with a bug would write it: the checksum matches
        import xxhash

        digest = xxhash.xxh3_128(path.name.encode() + np.asarray(ids).tobytes()).digest()  # as _write computes it
        with open(path, "r+b") as handle:
            handle.seek(-16, os.SEEK_END)
            handle.write(digest)
    del ids
    if how == "another epoch's file":  # whole, checksummed, of the right length: epoch 1's under epoch 0's name
        other = path.with_name(path.name.replace("-epoch-0.npy", "-epoch-1.npy"))
        assert wait_for(other.exists)  # built ahead by the first read
        path.write_bytes(other.read_bytes())
    if how == "cut short":
        os.truncate(path, os.path.getsize(path) - 1)
    elif how == "another shape":
        np.save(path, np.arange(10, dtype=np.uint32))


def an_epochs_file(mixture: DataConfig, directory) -> tuple[DataConfig, int, list]:
    """The mixture with its orders in `directory`, epoch 0's file built; the micro-batches of 8 in an epoch, and what
    they read without files."""
    files = dataclasses.replace(mixture, order_dir=str(directory))
    epoch = sum(open_dataset(mixture).epoch_samples(BatchPlan(8, 1, 1))) // 8
    want, _ = read(mixture, BatchPlan(8, 8, 1), epoch)
    read(files, BatchPlan(8, 8, 1), 1)
    return files, epoch, want


@pytest.mark.parametrize("how", ["halves swapped", "five ids overwritten", "an id out of range",
                                 "an id out of range, checksummed", "cut short", "another shape",
                                 "another epoch's file"])
def test_a_damaged_order_file_is_rebuilt_with_one_line_naming_it_and_never_read(mixture, tmp_path, how):
    """Every file ends with a checksum of its ids, checked (with every id's range) before any process reads it: a
    relaunch after the file changed reads exactly what it would have read without files, and says which file it
    rebuilt; train/build_orders.py's path (build_order_files) checks the files it finds alike."""
    files, epoch, want = an_epochs_file(mixture, tmp_path / "orders")
    directory, name = tmp_path / "orders", epoch_files(tmp_path / "orders")[0]
    damage(directory / name, how)
    said = "holds sample id .* outside the dataset's" if how.endswith("checksummed") else ""
    with pytest.warns(UserWarning, match=f"{name} {said}.*building it again"):
        got, _ = read(files, BatchPlan(8, 8, 1), epoch)
    assert got == want
    damage(directory / name, how)
    order = SampleOrder(open_dataset(files), 8)
    try:
        with pytest.warns(UserWarning, match=f"{name} .*building it again"):
            assert order.build_order_files(range(1)) == [str(directory / name)]
        assert order_files.problem_with(directory / name, order_inputs(order._loader.dataset)) is None
    finally:
        order.close()


def test_a_damaged_order_file_that_cannot_be_rebuilt_is_computed_in_memory_with_one_line(mixture, tmp_path,
                                                                                         monkeypatch):
    """The disk full when the file is found damaged (its free space read as none: a real full disk is
    test_an_order_dir_without_room's): the reader says the file is damaged and that it computes the order in memory,
    and reads exactly the order."""
    files, epoch, want = an_epochs_file(mixture, tmp_path / "orders")
    directory, name = tmp_path / "orders", epoch_files(tmp_path / "orders")[0]
    damage(directory / name, "halves swapped")
    full = order_files.shutil.disk_usage(directory)._replace(free=0)
    monkeypatch.setattr(order_files.shutil, "disk_usage", lambda path: full)
    with pytest.warns(UserWarning) as said:
        got, _ = read(files, BatchPlan(8, 8, 1), epoch)
    assert got == want
    lines = [str(w.message) for w in said]
    assert any(name in line and "building it again" in line for line in lines)
    assert any("computes it in memory" in line for line in lines)


def test_builders_racing_for_one_epoch_build_it_once(mixture, tmp_path):
    """Four processes ask for one epoch's order at once (train/build_orders.py's path): one builds it, the others wait
    for it and take the same file, and no partial file is left."""
    files = dataclasses.replace(mixture, order_dir=str(tmp_path / "orders"))
    code = ("import dataclasses, os, sys; from tokstream.reader import DataConfig, SampleOrder, StreamConfig, open_dataset;"
            "config = eval(sys.stdin.readline()); order = SampleOrder(open_dataset(config), 8); print('ready', flush=True);"
            "sys.stdin.readline(); print(os.stat(order.build_order_files(range(4, 5))[0]).st_ino); order.close()")
    racers = [WarmPython("-c", code, cwd=ROOT) for _ in range(4)]
    for racer in racers:
        racer.stdin.write(repr(files) + "\n")
        racer.stdin.flush()
    assert [racer.stdout.readline().strip() for racer in racers] == ["ready"] * 4  # all opened: they start together
    for racer in racers:
        racer.stdin.write("go\n")
        racer.stdin.close()
    inodes = {racer.stdout.read().strip() for racer in racers}
    assert [racer.wait() for racer in racers] == [0] * 4
    assert len(inodes) == 1 and set(epoch_files(tmp_path / "orders")) == {4}
    assert inodes == {str(os.stat(tmp_path / "orders" / epoch_files(tmp_path / "orders")[4]).st_ino)}
    assert not [name for name in os.listdir(tmp_path / "orders") if name.endswith(".partial")]
    whole, _ = read(files, BatchPlan(8, 8, 1), 5 * sum(open_dataset(mixture).epoch_samples(BatchPlan(8, 1, 1))) // 8)
    stock, _ = read(mixture, BatchPlan(8, 8, 1), len(whole))
    assert whole == stock  # epoch 4 read from the racers' file


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


@pytest.mark.long
def test_a_run_started_before_auto_resumes_in_its_own_order_and_keeps_its_orders_in_run_dir(dataset, tmp_path):
    """A run whose config named py1e (as every run's did, py1e being the default before `auto`), SIGTERMed and
    relaunched with a config that leaves data.shuffle_algo to `auto` on data `auto` would read in the lazy order:
    it goes on in py1e, every step's samples and loss bitwise as an uninterrupted run's; its epochs' orders are files
    in its run_dir, and the checkpoint's config says py1e again."""
    import signal

    from test_training import finish, launch, metrics, train, wait_for

    from tokstream.train.checkpoint import find_latest
    from tokstream.train.checkpoint_files import latest_step
    from tokstream.train.run_store import LocalRunStore

    from test_training import BASE

    threshold = ["data.lazy_order_from=64"]
    train(1, dataset, tmp_path / "reference", "data.shuffle_algo=py1e", *threshold)
    run_dir, store = tmp_path / "interrupted", LocalRunStore(str(tmp_path / "interrupted"))
    ahead = run_warm("train/build_orders.py", *BASE, f"data.remote={dataset}", f"run_dir={run_dir}",
                     "data.shuffle_algo=py1e", *threshold, "--epochs", "2", cwd=ROOT)
    assert ahead.returncode == 0, ahead.stderr
    assert ahead.stdout.startswith("the data: epochs 0-1 of py1e in ") and sorted(epoch_files(run_dir / "orders")) == [0, 1]
    built = {name: os.stat(run_dir / "orders" / name).st_ino for name in os.listdir(run_dir / "orders")}
    first = launch(1, dataset, run_dir, "data.shuffle_algo=py1e", *threshold, warm=True)
    wait_for(lambda: (latest_step(store) or 0) >= 4 and len(metrics(run_dir)) >= 5)
    first.send_signal(signal.SIGTERM)
    first.communicate(timeout=120)
    assert first.returncode == 75  # preempted, not ended
    finish(launch(1, dataset, run_dir, *threshold, warm=True))
    assert [(m["step"], m["samples"], m["loss"]) for m in metrics(run_dir)] == \
        [(m["step"], m["samples"], m["loss"]) for m in metrics(tmp_path / "reference")]
    assert {name: os.stat(run_dir / "orders" / name).st_ino for name in built} == built  # mapped, not built again
    listing = sorted(os.listdir(run_dir / "orders"))
    ledger = run_warm(ROOT / "train/ledger.py", run_dir, "--step", "16", cwd=tmp_path)
    assert ledger.returncode == 0, ledger.stderr
    assert sorted(os.listdir(run_dir / "orders")) == listing  # the ledger computes; it writes nothing
    later = run_warm("train/build_orders.py", *BASE, f"data.remote={dataset}", f"run_dir={run_dir}", *threshold,
                     "--epochs", "3", cwd=ROOT)
    assert later.stdout.startswith("the data: epochs 0-2 of py1e in "), later.stderr  # the run's own order, as it reads
    (tmp_path / "a-file").write_text("")
    nowhere = run_script("train/build_orders.py", *BASE, f"data.remote={dataset}", f"run_dir={tmp_path / 'other'}",
                         f"data.order_dir={tmp_path / 'a-file'}", cwd=ROOT)  # fresh: its stderr is compared whole
    assert nowhere.returncode != 0 and nowhere.stderr.strip() == (
        f"error: data.order_dir {tmp_path / 'a-file'}: the epochs' orders cannot be built there (File exists): give a "
        "folder with room, or leave the readers to build them")
    lazy = run_warm("train/build_orders.py", *BASE, f"data.remote={dataset}", f"run_dir={tmp_path / 'lazy'}",
                    *threshold, cwd=ROOT)
    assert lazy.stdout == "the data: read in lazy, which keeps no files: nothing to build\n", lazy.stderr
    _, saved = find_latest(store)
    assert saved["run"]["config"]["data"]["shuffle_algo"] == "py1e"


READ_SCRIPT = """
import json, sys, warnings
from tokstream.reader import BatchPlan, DataConfig, StreamConfig, TrainBatches, open_dataset
config, micro_batches = eval(sys.argv[1]), int(sys.argv[2])
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    batches = TrainBatches(open_dataset(config), BatchPlan(8, 4, 1))
    ids = [next(batches)["ids"].tolist() for _ in range(micro_batches)]
    batches.close()
print(json.dumps({"ids": ids, "warnings": [str(w.message) for w in said if "order_dir" in str(w.message)]}))
"""


def test_an_order_dir_without_room_or_that_is_no_folder_warns_once_and_reads_the_same(mixture, tmp_path):
    """The files only save work: where one cannot be written (a full disk, a path that is a file) the reader warns
    once and computes the same order in memory, leaving no partial file."""
    import json

    from test_full_disk import namespaces_permitted, on_a_small_disk, sh

    steps = 3 * sum(open_dataset(mixture).epoch_samples(BatchPlan(8, 1, 1))) // 4
    stock, _ = read(mixture, BatchPlan(8, 4, 1), steps)
    (tmp_path / "a-file").write_text("not a folder")
    for order_dir, run in ((tmp_path / "a-file", None), (tmp_path / "disk" / "orders", on_a_small_disk)):
        config = repr(dataclasses.replace(mixture, order_dir=str(order_dir)))
        command = [sys.executable, "-c", READ_SCRIPT, config, str(steps)]
        if run is None:
            reader = WarmPython(*command[1:], cwd=tmp_path)
            stdout, stderr = reader.communicate(timeout=300)
            done = subprocess.CompletedProcess(command, reader.returncode, stdout, stderr)
        else:
            if not namespaces_permitted():
                continue
            fill = f"(head -c 1m /dev/zero > {tmp_path / 'disk' / 'filler'} || true)"  # the disk full, then the run
            left = f"ls -A {order_dir} > {tmp_path / 'left.txt'}"  # before the disk goes with its namespace
            done = run(tmp_path / "disk", "64k", f"{fill} && PYTHONPATH={ROOT} {sh(*command)} && {left}")
        assert done.returncode == 0, done.stderr
        got = json.loads(done.stdout.splitlines()[-1])
        assert got["ids"] == stock
        assert len(got["warnings"]) == 1 and got["warnings"][0].startswith(f"data.order_dir {order_dir}: the epoch's "
                                                                           "order cannot be kept there (")
    if namespaces_permitted():
        assert not [name for name in (tmp_path / "left.txt").read_text().split() if name.endswith(".partial")]

