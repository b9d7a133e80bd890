"""The project's fast reader (tokstream/reader/token_dataset.py) against stock StreamingDataset.

Same samples, same order, for several seeds, worker counts and resume points; under a small
cache_limit with a remote dataset (shards evicted and fetched again) the samples stay exact.
Stock's batches come from streaming as shipped, in a process of its own (tests/stock_streaming.py):
this one has the project's replacements installed in streaming.
"""

import gc
import json
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import shakespeare_paragraphs

from tokstream.convert.cleaning import Cleaning
from tokstream.convert.options import ConversionOptions
from tokstream.convert.text_conversion import convert_text
from tokstream.reader import token_loader
from tokstream.reader.batches import make_loader, to_device
from tokstream.reader.config import DataConfig

BATCH = 8


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, gpt2):
    tmp = tmp_path_factory.mktemp("fast")
    corpus = tmp / "plays.txt"
    corpus.write_text("\n\n".join(shakespeare_paragraphs()) + "\n")
    convert_text([str(corpus)], str(tmp / "ds"), {"txt_docs": "paragraph"}, Cleaning(),
                 ConversionOptions(block_size=64, val_fraction=0, shard_size="64kb", progress=False), gpt2)
    return tmp / "ds"


def fresh_copy(dataset, tmp_path, name):
    """Each StreamingDataset gets its own directory: streaming refuses two live ones on one."""
    target = tmp_path / name
    shutil.copytree(dataset, target)
    return target


def stock_run(stock, dataset, seed: int, workers: int, **run) -> dict[str, np.ndarray]:
    """Stock StreamingDataset + StreamingDataLoader over the dataset (stock_streaming.loader_batches)."""
    return stock.run("loader_batches", [dataset], root=str(dataset), seed=seed, workers=workers, batch_size=BATCH,
                     **run)


def stock_batches(stock, dataset, seed: int, workers: int, **run) -> np.ndarray:
    """Stock's token batches, stacked."""
    return stock_run(stock, dataset, seed, workers, **run)["tokens"]


def project_loader(root, seed: int, workers: int, reuse_slots: bool = False, **data):
    config = DataConfig(remote=str(root), shuffle_seed=seed, num_workers=workers, **data)
    return make_loader(config, "train", BATCH, shuffle=True, pin_memory=False, reuse_slots=reuse_slots)


@pytest.mark.parametrize("seed, workers", [(1, 0), (424242, 0)])  # with workers: below
def test_same_samples_same_order_as_stock(dataset, tmp_path, stock, seed, workers):
    expected = stock_batches(stock, dataset, seed, workers)
    loader = project_loader(fresh_copy(dataset, tmp_path, "ours"), seed, workers)
    got = [batch["tokens"].numpy().copy() for batch in loader]
    assert loader.dataset.num_samples > 4000 and len(got) == len(expected)
    assert got[0].dtype == np.uint16  # stays narrow until the device
    np.testing.assert_array_equal(np.stack(got), expected)


@pytest.mark.parametrize("workers, transfer_samples, ring", [(1, 256, True), (2, 8, False), (2, 8, True),
                                                             (3, 24, True), (8, 40, False)])  # 2 at 256: resume
def test_workers_sending_several_batches_at_once_keep_stocks_order(dataset, tmp_path, stock, monkeypatch, workers,
                                                                    transfer_samples, ring):
    """Workers hand over several micro-batches per transfer (token_loader.py), pickled or written into
    the shared ring training uses (transfer_ring.py); the rank must still yield stock's micro-batches
    in stock's order, over two epochs, including each worker's last, short transfer (3 and 8
    workers leave the workers' shares uneven, so some run out a round early)."""
    monkeypatch.setattr(token_loader, "TRANSFER_SAMPLES", transfer_samples)
    expected = stock_batches(stock, dataset, 5, workers, epochs=2)
    loader = project_loader(fresh_copy(dataset, tmp_path, "ours"), 5, workers, reuse_slots=ring)
    got = [batch["tokens"].numpy().copy() for _ in range(2) for batch in loader]
    del loader
    gc.collect()
    assert len(got) == len(expected) > 1000
    np.testing.assert_array_equal(np.stack(got), expected)


@pytest.mark.parametrize("workers, transfer_samples", [(1, 8), (3, 24)])
def test_a_ring_slot_is_rewritten_only_after_a_round_more_was_yielded(dataset, tmp_path, stock, monkeypatch, workers,
                                                                      transfer_samples):
    """With the ring, micro-batches are views of a few slots per worker, written once by the worker and
    never copied in the rank; each stays intact while the consumer takes one more round (a
    transfer from every worker), which covers a training loop that copies a micro-batch to the
    device before asking for the next. Workers far ahead wait for their slots (the epoch has far
    more transfers than slots)."""
    monkeypatch.setattr(token_loader, "TRANSFER_SAMPLES", transfer_samples)
    expected = stock_batches(stock, dataset, 9, workers)
    loader = project_loader(fresh_copy(dataset, tmp_path, "ours"), 9, workers, reuse_slots=True)
    window = workers * transfer_samples // BATCH  # micro-batches in a round
    held, pointers = [], set()
    for index, batch in enumerate(loader):
        held = (held + [batch["tokens"]])[-window - 1:]  # no copy: the slot itself
        pointers.add(batch["tokens"].data_ptr())
        for back, tokens in enumerate(reversed(held)):
            np.testing.assert_array_equal(tokens.numpy(), expected[index - back])
    slots = (2 + 3) * window  # prefetch_factor 2, + 3 slots a worker, of `window // workers` micro-batches each
    assert index + 1 == len(expected) > 5 * slots and len(pointers) == slots
    del held, batch, loader
    gc.collect()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the ring's CUDA registration")
def test_on_a_gpu_worker_batches_land_pinned_in_the_ring_and_reach_the_device_exact(dataset, tmp_path, stock):
    """Training's path on a GPU: pinned where the worker wrote them (a few slots' addresses, so no
    pinning copy per transfer), and the device gets stock's tokens, copied without blocking."""
    expected = stock_batches(stock, dataset, 5, 2)
    config = DataConfig(remote=str(fresh_copy(dataset, tmp_path, "ours")), shuffle_seed=5, num_workers=2)
    loader = make_loader(config, "train", BATCH, shuffle=True, pin_memory=True, reuse_slots=True)
    inputs, pointers = [], set()
    for batch in loader:
        assert batch["tokens"].is_pinned()
        pointers.add(batch["tokens"].data_ptr())
        inputs.append(to_device(batch, torch.device("cuda"))[0])
    assert len(inputs) == len(expected) and len(pointers) <= 2 * (2 + 3) * token_loader.TRANSFER_SAMPLES // BATCH
    np.testing.assert_array_equal(torch.stack(inputs).cpu().numpy(), expected[:, :, :-1].astype(np.int64))


class UnevenShares(torch.utils.data.IterableDataset):
    """Worker w has SHARES[w] samples, yielded one by one (per_item=None) or, as TokenDataset yields
    them in a worker, as transfers of up to `per_item` samples kept to whole micro-batches of 2. The
    workers run out rounds apart, which streaming's balanced partitions never do, but the
    DataLoader's round order defines what happens then."""

    SHARES = (70, 3, 0, 33, 1)

    def __init__(self, per_item: int | None):
        self.per_item = per_item

    def __iter__(self):
        worker = torch.utils.data.get_worker_info().id
        ids = [100 * worker + index for index in range(self.SHARES[worker])]
        if self.per_item is None:
            yield from ({"id": sample_id} for sample_id in ids)
            return
        for start in range(0, len(ids), self.per_item):
            kept = ids[start:start + self.per_item]
            if kept := kept[:len(kept) // 2 * 2]:
                yield {"worker": worker, "tokens": np.zeros((len(kept) // 2, 2, 1)), "ids": np.array(kept).reshape(-1, 2)}


def test_transfers_follow_the_dataloaders_round_order_when_workers_run_out_rounds_apart():
    workers = len(UnevenShares.SHARES)
    stock = torch.utils.data.DataLoader(UnevenShares(None), batch_size=2, num_workers=workers, drop_last=True)
    expected = [batch["id"].tolist() for batch in stock]
    transfers = torch.utils.data.DataLoader(UnevenShares(6), batch_size=None, num_workers=workers,
                                            collate_fn=lambda transfer: transfer)  # as TokenLoader: numpy kept
    got = [batch["ids"].tolist() for batch in token_loader.in_stock_order(iter(transfers), workers, False)]
    assert got == expected and len(expected) == 35 + 1 + 16


@pytest.mark.parametrize("workers, epoch, ring", [(0, 5, False), (0, 21, False), (3, 21, False), (3, 21, True),
                                                 (3, 45, True)])
def test_an_epoch_smaller_than_a_batch_or_a_round_of_workers_gives_stocks_batches(dataset, tmp_path, stock, workers,
                                                                                  epoch, ring):
    """Epochs of fewer samples than a batch, or than one batch per worker: some workers get no whole
    micro-batch, or only a partial one to drop (all of the epoch, at 5 samples). Two epochs (a ring
    each), against stock."""
    reference = stock_run(stock, dataset, 2, workers, epochs=2, choose=epoch)
    config = DataConfig(remote=str(fresh_copy(dataset, tmp_path, "ours")), shuffle_seed=2, num_workers=workers)
    loader = make_loader(config, "train", BATCH, shuffle=True, pin_memory=False, choose=[epoch], reuse_slots=ring)
    got = [batch["tokens"].numpy().copy() for _ in range(2) for batch in loader]
    epoch_size = loader.dataset.epoch_size
    del loader
    gc.collect()
    # Both epochs hold `epoch` samples, so what is not yielded is the partial batch, dropped, as stock does.
    assert epoch_size == int(reference["epoch_size"]) == epoch
    assert len(got) == len(reference["tokens"]) == 2 * (epoch // BATCH)
    if epoch >= BATCH:
        np.testing.assert_array_equal(np.stack(got), reference["tokens"])


@pytest.mark.parametrize("workers, resume_workers, resume_after", [(2, 2, 45), (3, 1, 7), (1, 3, 200)])
def test_a_checkpoint_between_transfers_resumes_like_stock(dataset, tmp_path, stock, workers, resume_after,
                                                           resume_workers):
    """The state after any micro-batch is stock's after the same micro-batches, whatever the workers had
    read ahead, and a relaunch (with another worker count) continues as stock does from it. The first
    run reads through the ring (as training does), the relaunch without it."""
    loader = project_loader(fresh_copy(dataset, tmp_path, "ours"), 11, workers, reuse_slots=True)
    ours_it = iter(loader)
    first = [next(ours_it)["tokens"].numpy().copy() for _ in range(resume_after)]
    state = loader.state_dict()
    del ours_it, loader
    gc.collect()
    reference = stock_run(stock, dataset, 11, workers, stop_after=resume_after)
    np.testing.assert_array_equal(np.stack(first), reference["tokens"])
    assert state == json.loads(str(reference["state"])) and state["sample_in_epoch"] == resume_after * BATCH

    resumed = project_loader(fresh_copy(dataset, tmp_path, "ours2"), 11, resume_workers)
    resumed.load_state_dict(state)
    got = [batch["tokens"].numpy().copy() for batch in resumed]
    del resumed
    gc.collect()
    expected = stock_batches(stock, dataset, 11, resume_workers, state=state)
    assert len(got) == len(expected) > 0
    np.testing.assert_array_equal(np.stack(got), expected)


@pytest.mark.parametrize("resume_after", [1, 57, 300])
def test_resume_points_continue_like_stock(dataset, tmp_path, stock, resume_after):
    loader = project_loader(fresh_copy(dataset, tmp_path, "ours"), 7, 0)
    iterator = iter(loader)
    for _ in range(resume_after):
        next(iterator)
    state = loader.state_dict()
    del iterator, loader
    gc.collect()

    resumed = project_loader(fresh_copy(dataset, tmp_path, "ours2"), 7, 0)
    resumed.load_state_dict(state)
    got = [batch["tokens"].numpy().copy() for batch in resumed]
    del resumed
    gc.collect()
    expected = stock_batches(stock, dataset, 7, 0, state=state)
    assert len(got) == len(expected) > 0
    np.testing.assert_array_equal(np.stack(got), expected)


def test_streamings_file_locks_are_prompt_ones_and_still_exclude(dataset, tmp_path):
    """The barrier every rank and worker passes at each epoch start, and the cache lock, poll every
    millisecond when held by another (PromptFileLock), and are still locks: held, nobody else gets them."""
    from filelock import Timeout

    from tokstream.reader.streaming_door.streaming_internals import LOCK_POLL_S, PromptFileLock, file_locks

    loader = project_loader(fresh_copy(dataset, tmp_path, "ours"), 1, 0)
    next(iter(loader))
    for lock in file_locks(loader.dataset):
        assert type(lock) is PromptFileLock, lock.lock_file
        assert LOCK_POLL_S < 0.05  # filelock's own default: 50 ms
        other = PromptFileLock(lock.lock_file)  # another open file: flock excludes it as it would another process
        with lock:
            with pytest.raises(Timeout):
                other.acquire(timeout=0.05)
        with other.acquire(timeout=5):
            assert other.is_locked
    del loader


def mapped_deleted_files(directory: Path) -> set[str]:
    """Files under `directory` that this process still maps although they were deleted."""
    maps = Path("/proc/self/maps").read_text().splitlines()
    return {line.split(maxsplit=5)[5] for line in maps if str(directory) in line and line.endswith("(deleted)")}


def test_eviction_under_a_small_cache_limit_keeps_samples_exact(dataset, tmp_path, stock):
    """From S3 on loopback with a cache far smaller than the 11 shards: shards are evicted and fetched again."""
    from tokstream.object_store import S3Dataset
    from tokstream.testing.loopback_s3 import start_loopback_s3

    saved = dict(os.environ)
    server = start_loopback_s3("evict")
    try:
        store = S3Dataset("s3://evict/ds")
        for path in sorted(dataset.rglob("*")):
            if path.is_file():
                store.upload(path, path.relative_to(dataset).as_posix())
        shards = len(list((dataset / "train").glob("shard.*")))
        # Shuffle blocks of ~2 shards: the cache cycles through the dataset instead of thrashing.
        expected = np.concatenate(stock_batches(stock, dataset, 3, 0, shuffle_block_size=1000))

        cache = tmp_path / "cache"
        config = DataConfig(remote="s3://evict/ds", local=str(cache), shuffle_seed=3, num_workers=0,
                            cache_limit="300kb", predownload=64, shuffle_block_size=1000)
        loader = make_loader(config, "train", BATCH, shuffle=True, pin_memory=False)
        got, most_local, most_deleted_mapped = [], 0, 0
        for batch in loader:
            got.append(batch["tokens"].numpy().copy())
            most_local = max(most_local, len(list((cache / "train").glob("shard.*.mds"))))
            most_deleted_mapped = max(most_deleted_mapped, len(mapped_deleted_files(cache)))
        np.testing.assert_array_equal(np.concatenate(got), expected)
        assert shards > 8 and most_local < shards  # shards were evicted (and some fetched again)
        # An evicted shard's disk space is really freed: its mapping goes when the reader maps its next
        # shard, so at most what the download-ahead window evicts meanwhile stays mapped (2 seen), not
        # every evicted shard until it is read again (7 of the 11 before).
        assert most_deleted_mapped <= 3, most_deleted_mapped
        del loader
        gc.collect()
    finally:
        server.stop()
        os.environ.clear()
        os.environ.update(saved)


def test_a_shard_whose_download_failed_is_fetched_again_not_waited_for_forever(dataset, tmp_path):
    """Stock streaming leaves a shard whose download failed marked "being downloaded": every other
    thread and rank of the node that needs it then waits forever. Here it goes back to remote, with
    no partial file left, and the next try downloads it again (failing the same way while the
    cause lasts; succeeding once it is gone)."""
    import threading

    from tokstream.reader.streaming_door import streaming_internals as internals

    remote = fresh_copy(dataset, tmp_path, "remote")
    shard = remote / "train" / "shard.00003.mds"
    intact = shard.read_bytes()
    shard.unlink()
    shard.mkdir()  # the copy fails: a real IsADirectoryError, in streaming's own downloader
    loader = project_loader(remote, 1, 0, local=str(tmp_path / "cache"), download_retry=1)  # 1 try, no backoff
    ds = loader.dataset
    for _ in range(2):  # stock: the second call waits for the first's download, forever
        outcome = []
        attempt = threading.Thread(target=lambda: outcome.append(_raised(lambda: ds.prepare_shard(3))), daemon=True)
        attempt.start()
        attempt.join(timeout=20)
        assert outcome and isinstance(outcome[0], IsADirectoryError), "the shard was waited for, not fetched"
        assert not internals.shard_is_local(ds, 3) and not list((tmp_path / "cache" / "train").glob("*.tmp"))
    shard.rmdir()
    shard.write_bytes(intact)
    ds.prepare_shard(3)
    assert internals.shard_is_local(ds, 3) and (tmp_path / "cache" / "train" / shard.name).read_bytes() == intact
    del loader, ds
    gc.collect()


def _raised(call) -> BaseException | None:
    try:
        call()
    except BaseException as err:  # noqa: BLE001  (the test looks at what it was)
        return err
    return None


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_tokens_reach_the_model_as_exact_int64_inputs_and_targets(dtype):
    """The highest token ids survive the trip: no sign flip from the narrow unsigned dtype."""
    top = np.iinfo(dtype).max
    rows = [np.array([0, 1, 32767, 32768, 50256, top], dtype=dtype),
            np.array([top, top - 1, 65535, 65536 % (top + 1), 7, 100000 % (top + 1)], dtype=dtype)]
    inputs, targets = to_device({"tokens": torch.from_numpy(np.stack(rows))}, torch.device("cpu"))
    expected = torch.from_numpy(np.stack(rows).astype(np.int64))
    assert inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(inputs, expected[:, :-1]) and torch.equal(targets, expected[:, 1:])


WORKERS_SCRIPT = r"""
import gc, os, sys, time
from pathlib import Path
from tokstream.reader.batches import make_loader
from tokstream.reader.config import DataConfig
from tokstream.testing.processes import descendants

def workers() -> list[int]:  # forked: the same command line as this process
    me = Path("/proc/self/cmdline").read_bytes()
    return [pid for pid in descendants(os.getpid()) if Path(f"/proc/{pid}/cmdline").read_bytes() == me]

loader = make_loader(DataConfig(remote=sys.argv[1], num_workers=2), "train", 8, shuffle=True, pin_memory=False,
                     reuse_slots=sys.argv[3] == "ring")
batches = iter(loader)
next(batches)
before, started = workers(), time.monotonic()
del batches  # the DataLoader ends its workers
gc.collect()
print("ended", len(before), len(workers()), round(time.monotonic() - started, 1))
batches = iter(loader)
next(batches)
print("workers", *workers(), flush=True)
sys.stdin.readline()  # the test has seen them running (a rank that raised at once could end them first)
if sys.argv[2] == "raise":
    raise SystemExit(3)  # with the loader alive
time.sleep(600)
"""


def running(pid: int) -> bool:
    """Whether the process exists and is not a zombie (an orphan's exit is reaped by whoever is init)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("end, transfers", [("raise", "pickled"), ("sigkill", "pickled"), ("raise", "ring"),
                                             ("sigkill", "ring")])
def test_dataloader_workers_end_with_their_loader_and_with_their_rank(dataset, tmp_path, end, transfers):
    """Workers ignore SIGTERM (only the rank reacts to a preemption), so they must end by themselves:
    when the loader is done with them, when the rank exits on an exception with the loader alive
    (multiprocessing's exit used to wait forever for them), and when the rank is SIGKILLed (the
    DataLoader's watchdog notices within 5 s; streaming's download-ahead threads used to keep them).
    With the ring, the workers are by then waiting for slots the rank will not release."""
    import subprocess
    import sys
    import threading
    import time

    from conftest import ROOT

    rank = subprocess.Popen([sys.executable, "-c", WORKERS_SCRIPT, str(fresh_copy(dataset, tmp_path, "ds")), end, transfers],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    watchdog = threading.Timer(120, rank.kill)  # a hang fails the test rather than the suite
    watchdog.start()
    workers: list[int] = []
    try:
        ended = rank.stdout.readline().split()
        assert ended[:3] == ["ended", "2", "0"] and float(ended[3]) < 4, ended  # without the 5 s join timeout
        workers = [int(pid) for pid in rank.stdout.readline().split()[1:]]
        assert len(workers) == 2 and all(running(pid) for pid in workers)
        rank.stdin.write("go\n")
        rank.stdin.flush()
        if end == "sigkill":
            rank.kill()
        assert rank.wait() == (3 if end == "raise" else -signal.SIGKILL)
        deadline = time.monotonic() + 20
        while any(running(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(running(pid) for pid in workers), "the rank's DataLoader workers still run"
    finally:
        watchdog.cancel()
        for pid in [rank.pid, *workers]:  # nothing left behind if the test fails
            if running(pid):
                os.kill(pid, signal.SIGKILL)


FAILING_ORDER_SCRIPT = """
import sys
from tokstream.reader.batches import make_loader
from tokstream.reader.config import DataConfig
from tokstream.reader.streaming_door.streaming_internals import install_shuffle

def failing(*args, **kwargs):
    raise RuntimeError("the epoch's order failed")

install_shuffle("fails", failing)  # forked workers inherit it: the first worker fails building the order
loader = make_loader(DataConfig(remote=sys.argv[1], shuffle_algo="fails", num_workers=2), "train", 4, shuffle=True,
                     pin_memory=False)
next(iter(loader))
"""


def test_a_worker_that_fails_building_the_order_ends_the_rank_not_hangs_it(dataset, tmp_path):
    """The first worker of a node builds the epoch's order while the second waits in streaming for it. When building
    fails, the rank raises and exits; the waiting worker, which ignores SIGTERM, used to keep the rank's exit waiting
    for it for ever (seen with a mistyped shuffle, before that was refused at start)."""
    import subprocess
    import sys

    from conftest import ROOT

    rank = subprocess.Popen([sys.executable, "-c", FAILING_ORDER_SCRIPT, str(fresh_copy(dataset, tmp_path, "ds"))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        _, errors = rank.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        rank.kill()
        raise AssertionError("the rank hung at exit behind its waiting DataLoader worker") from None
    assert rank.returncode != 0 and "the epoch's order failed" in errors, errors[-2000:]
