"""The public reader API (tokstream.reader) as a loop of one's own uses it, in one process: the samples of a
mixture with their sources, a resume from state_dict() between any two micro-batches, and close(); and in two
ranks, the state rank 0 saves after the other rank has closed, and a rank killed before an epoch starts."""

import json
import multiprocessing
import subprocess
import sys
import time

import pytest
from conftest import ROOT, split_samples
from test_training import tiny_splits
from warm_ranks import WarmPython

from tokstream.errors import UserError
from tokstream.reader import (BatchPlan, DataConfig, StreamConfig, TrainBatches, eval_batches, open_dataset,
                              to_device)
from tokstream.reader.stale_shm import OWNER_MARK, SHM_DIR


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


SAVING_RANK = """
import json, os, sys
rank, store, data, after = sys.argv[1:]
os.environ.update(RANK=rank, WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", LOCAL_RANK=rank)
import torch.distributed as dist
from tokstream.reader import BatchPlan, DataConfig, TrainBatches, open_dataset
dist.init_process_group("gloo", init_method=f"file://{store}", rank=int(rank), world_size=2)
plan = BatchPlan(8, 4, 2)
first = TrainBatches(open_dataset(DataConfig(remote=data)), plan)
for _ in range(2):
    next(first)
state = [first.state_dict()]
dist.broadcast_object_list(state, 0)
first.close()
resumed = TrainBatches(open_dataset(DataConfig(remote=data)), plan)
for loads in ("1", "0"):  # rank 1 loads first: the node's resume block is then its
    if rank == loads:
        resumed.load_state_dict(state[0])
    dist.barrier()
for _ in range(int(after)):
    next(resumed)
if rank == "1":
    resumed.close()  # a rank that does not save leaves the loop first
dist.barrier()
if rank == "0":
    print(json.dumps(resumed.state_dict()))
    resumed.close()
dist.destroy_process_group()
"""


@pytest.mark.parametrize("after", [2, 5])  # steps after the resume: within its epoch, and into the next
def test_the_state_rank_0_saves_after_another_rank_closed_is_the_whole_position(mixture, tmp_path, after):
    """A DDP loop where rank 0 alone saves: the other rank may have closed (or exited) first. Stock streaming
    re-reads the position from the node's shared memory, which that rank had created and took with it: rank 0
    then saved only the samples taken since the resume, and the next resume read them again."""
    root = mixture.streams[0].remote  # 40 samples: 5 steps of 8 an epoch, resumed after 2
    ranks = [WarmPython("-c", SAVING_RANK, rank, tmp_path / "store", root, after, cwd=ROOT) for rank in (0, 1)]
    outputs = [rank.communicate(timeout=300) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    uninterrupted = TrainBatches(open_dataset(DataConfig(remote=root)), BatchPlan(8, 8, 1))
    for _ in range(2 + after):
        next(uninterrupted)
    assert json.loads(outputs[0][0]) == uninterrupted.state_dict()
    uninterrupted.close()


EPOCH_END_RANK = """
import json, os, sys, time
rank, store, data, workers, order = sys.argv[1:]
os.environ.update(RANK=rank, WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", LOCAL_RANK=rank)
import torch.distributed as dist
from tokstream.reader import BatchPlan, DataConfig, TrainBatches, open_dataset
from streaming import StreamingDataset
dist.init_process_group("gloo", init_method=f"file://{store}", rank=int(rank), world_size=2)
orders = {"lazy": {"shuffle_algo": "lazy"}, "files": {"order_dir": os.path.join(os.path.dirname(store), "orders")}}
plan, config = BatchPlan(8, 4, 2), DataConfig(remote=data, num_workers=int(workers), **orders[order])
first = TrainBatches(open_dataset(config), plan)
for _ in range(5):  # the whole first epoch: 40 samples, 5 steps
    next(first)
state = [first.state_dict()]
dist.broadcast_object_list(state, 0)
first.close()
if rank == "0":  # the node's first process (with workers, its first worker) is slow to say the second epoch is next
    stock = StreamingDataset.next_epoch
    StreamingDataset.next_epoch = property(stock.fget, lambda self, epoch: (time.sleep(4 if epoch == 1 else 0),
                                                                            stock.fset(self, epoch)))
resumed = TrainBatches(open_dataset(config), plan)
resumed.load_state_dict(state[0])
steps = []
for _ in range(6):  # the second epoch and the third's first step, the ranks kept in step as DDP's all-reduce does
    steps.append(next(resumed)["ids"].tolist())
    dist.barrier()
resumed.close()
print(json.dumps(steps))
dist.destroy_process_group()
"""


@pytest.mark.parametrize("order, workers", [("files", 0), ("lazy", 2)])
def test_a_resume_from_an_epoch_ends_checkpoint_reads_the_next_epoch_on_every_rank(mixture, tmp_path, order, workers):
    """Resumed at the epoch's end, every process of the node has an empty epoch and starts the next at once, while
    the node's first process sets which epoch is next only after their barrier. In the orders that do not wait for
    the node's first to share the epoch's order (kept as files, as the trainer keeps them, and lazy), a rank that
    looked before it had (here the first is made slow there, as a loaded machine deschedules it) took the empty
    epoch again and was then a barrier ahead: the ranks waited for each other for ever (the random interruption
    schedule's seed 33038, 4 hangs in 6 runs). Each step's global batch is an uninterrupted run's."""
    root = mixture.streams[0].remote  # 40 samples: 5 steps of 8 an epoch
    ranks = [WarmPython("-c", EPOCH_END_RANK, rank, tmp_path / "store", root, workers, order, cwd=ROOT)
             for rank in (0, 1)]
    try:
        outputs = [rank.communicate(timeout=60) for rank in ranks]  # about 6 s, 4 of them the first rank's delay
    except subprocess.TimeoutExpired:
        for rank in ranks:
            rank.kill()
        raise AssertionError("the ranks waited for each other for ever after resuming at the epoch's end") from None
    assert [rank.returncode for rank in ranks] == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    orders = {"lazy": {"shuffle_algo": "lazy"}, "files": {}}
    uninterrupted = TrainBatches(open_dataset(DataConfig(remote=root, **orders[order])), BatchPlan(8, 8, 1))
    expected = [sorted(next(uninterrupted)["ids"].tolist()) for _ in range(11)][5:]
    uninterrupted.close()
    rank_0, rank_1 = (json.loads(output[0]) for output in outputs)
    assert [sorted(ids_0 + ids_1) for ids_0, ids_1 in zip(rank_0, rank_1)] == expected


ENDED_PEER = """
import os, sys
rank, store, data, workers, ending, ender = sys.argv[1:]
os.environ.update(RANK=rank, WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", LOCAL_RANK=rank)
import torch.distributed as dist
from tokstream.reader import BatchPlan, DataConfig, TrainBatches, open_dataset
dist.init_process_group("gloo", init_method=f"file://{store}", rank=int(rank), world_size=2)
batches = TrainBatches(open_dataset(DataConfig(remote=data, num_workers=int(workers))), BatchPlan(8, 4, 2))
for _ in range(5):  # the first epoch: 40 samples, 20 a rank
    next(batches)
print("read", flush=True)
if rank == ender and ending == "fails":
    raise RuntimeError("an error of its own")  # an ordinary exit: its reader is released on the way out
if rank == ender and ending == "closes":
    batches.close()  # and lives on
sys.stdin.readline()  # the ender is killed here (or ends with the test); the other reads on once it is
next(batches)  # the next epoch's start
print("next epoch", flush=True)
"""


def start_ranks(launches: list[list[str] | None], data: str, tmp_path, workers: int, ending: str, ender: int):
    """The two ranks: forked warm where the launch is None, else `python -c` after the launch's command (where the
    case is about that process's own start, exit or namespace)."""
    args = (tmp_path / "store", data, workers, ending, ender)
    return [WarmPython("-c", ENDED_PEER, rank, *args, cwd=ROOT) if launch is None else
            subprocess.Popen([*launch, sys.executable, "-c", ENDED_PEER, str(rank), *map(str, args)], cwd=ROOT,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for rank, launch in enumerate(launches)]


@pytest.mark.parametrize("ending, workers, ender", [("killed", 0, 1), ("fails", 1, 1), ("closes", 0, 1),
                                                    ("fails", 0, 0), ("killed", 1, 0)])
def test_a_rank_that_ends_before_an_epoch_starts_ends_its_node_peer_instead_of_leaving_it_waiting(
        mixture, tmp_path, ending, workers, ender):
    """Every process reading on a node waits for the others at streaming's barrier when an epoch starts (the rank
    itself, or its DataLoader worker); stock waits for ever for one that has ended (until torchrun's SIGKILL, or the
    job's time limit under srun). Here the waiting rank stops with one line naming the one that ended: killed (a
    zombie until the test reaps it), ended by an error of its own, or that closed its reader and lives on; the
    node's first rank (which made the node's blocks, and may take them with it) as well as another."""
    launches: list[list[str] | None] = [None, None]
    if ending != "closes":  # a new interpreter: a zombie once killed, or the interpreter's own exit when it fails
        launches[ender] = []
    ranks = start_ranks(launches, mixture.streams[0].remote, tmp_path, workers, ending, ender)
    ended, waiting = ranks[ender], ranks[1 - ender]
    try:
        assert [rank.stdout.readline() for rank in ranks] == ["read\n"] * 2
        if ending == "killed":
            ended.kill()  # not waited for: a zombie until the end of the test
        _, stderr = waiting.communicate("\n", timeout=60)  # stock: no end (the block below is its failure)
        assert waiting.returncode == 1, stderr[-3000:]
        assert (f"tokstream.errors.PeerEnded: process {ended.pid}, which read this dataset on this node (another "
                "rank of the job), ended or closed it while this process") in stderr, stderr[-3000:]
        if ending == "fails":  # its record, kept as released while the other held the dataset, went with it
            assert not list(SHM_DIR.glob(f"*_{OWNER_MARK}.{ended.pid}.*"))
    finally:
        for rank in ranks:
            rank.kill()
            rank.communicate()
        for record in SHM_DIR.glob(f"*_{OWNER_MARK}.{ended.pid}.*"):  # what the killed one left
            record.unlink()


def test_ranks_whose_pids_the_other_cannot_see_still_read_on_together(mixture, tmp_path):
    """Ranks of one node in containers of their own that share /dev/shm (each its own pid namespace): a rank's
    pid, read in the other's /proc, names another process or none. Neither is taken as ended, also while one
    waits for the other long enough to look."""
    unshare = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"]  # killing unshare kills the rank
    if subprocess.run([*unshare, "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare cannot make a pid namespace here (it needs root)")
    ranks = start_ranks([None, unshare], mixture.streams[0].remote, tmp_path, 0, "none", -1)
    try:
        assert [rank.stdout.readline() for rank in ranks] == ["read\n"] * 2
        for rank in ranks:  # the first reads on, and waits at the epoch's start for the other, which comes later
            rank.stdin.write("\n")
            rank.stdin.flush()
            time.sleep(1)
        outputs = [rank.communicate(timeout=60) for rank in ranks]
    finally:  # nothing left behind if it failed (a rank waiting for the other would wait for ever)
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.communicate()
    assert [rank.returncode for rank in ranks] == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    assert [out for out, _ in outputs] == ["next epoch\n"] * 2


NOTICED_RANK = """
import os, signal, sys
from tokstream.reader import BatchPlan, DataConfig, TrainBatches, open_dataset

noticed = []
signal.signal(signal.SIGUSR1, lambda *_: noticed.append(True))  # a loop's own notice handler
batches = TrainBatches(open_dataset(DataConfig(remote=sys.argv[1], num_workers=int(sys.argv[2]))), BatchPlan(8, 4, 1))
next(batches)
print("reading", flush=True)
sys.stdin.readline()  # the test sends the notice to the process group meanwhile
next(batches)
batches.close()  # its shared memory released: each block unregistered with the resource tracker
print("noticed", len(noticed), flush=True)
"""


@pytest.mark.parametrize("workers", [0, 2])
def test_a_notice_to_every_process_of_a_reading_rank_reaches_only_the_rank(mixture, workers):
    """Slurm's time-limit notice (`--signal=USR1@180`, the README's recipe) goes to every process of a job step:
    the rank, its DataLoader workers, and multiprocessing's resource tracker it started for streaming's shared
    memory. The tracker used to die of it; the one started again in its place printed that resources might leak,
    and a traceback for each block the rank released afterwards."""
    import os
    import signal
    from pathlib import Path

    from tokstream.testing.processes import descendants, signal_state

    rank = subprocess.Popen([sys.executable, "-c", NOTICED_RANK, mixture.streams[0].remote, str(workers)], cwd=ROOT,
                            start_new_session=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert rank.stdout.readline() == "reading\n"
        trackers = [pid for pid in descendants(rank.pid)
                    if b"resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(trackers) == 1, trackers
        os.killpg(rank.pid, signal.SIGUSR1)  # as slurmstepd signals the step's processes

        deadline = time.monotonic() + 30  # until the tracker is deaf to it (held back, or ignored), or has died
        while signal_state(trackers[0], signal.SIGUSR1) in ("open", "blocked", "pending"):
            assert time.monotonic() < deadline, "the notice never reached the resource tracker"
            time.sleep(0.01)
        assert signal_state(trackers[0], signal.SIGUSR1) in ("held", "ignored"), "the notice killed the tracker"
        said, errors = rank.communicate("go\n", timeout=120)
    finally:
        if rank.poll() is None:
            os.killpg(rank.pid, signal.SIGKILL)
            rank.wait()
    assert rank.returncode == 0 and said == "noticed 1\n", errors[-3000:]
    assert "leak" not in errors and "Traceback" not in errors, errors[-3000:]


def test_close_ends_the_dataloader_workers(mixture):
    dataset = open_dataset(DataConfig(streams=mixture.streams, num_workers=2))
    batches = TrainBatches(dataset, BatchPlan(8, 4, 1))
    next(batches)
    workers = multiprocessing.active_children()  # those still reading (one may be done with its part)
    assert workers
    batches.close()
    assert not any(worker.is_alive() for worker in workers)


@pytest.mark.parametrize("reuse_buffers", [False, True])
def test_micro_batches_kept_with_workers_stay_theirs_unless_buffers_are_reused(tmp_path, reuse_buffers):
    """Without reuse_buffers (the API's default), workers' micro-batches are the caller's to keep: an epoch of
    them, kept, still holds its samples' tokens. With reuse_buffers (the trainer's setting: each goes to the
    device at once) a ring slot is rewritten a few transfers of 256 samples later."""
    root = tiny_splits(tmp_path, 4000, 8)
    stored = split_samples(root)
    batches = TrainBatches(open_dataset(DataConfig(remote=str(root), num_workers=2)), BatchPlan(8, 4, 1),
                           reuse_buffers=reuse_buffers)
    kept = [next(batches) for _ in range(1000)]
    batches.close()
    intact = [tokens.tolist() == stored[sample_id].tolist()
              for batch in kept for tokens, sample_id in zip(batch["tokens"], batch["ids"].tolist())]
    assert all(intact) != reuse_buffers


def refusal(call) -> str:
    with pytest.raises(UserError) as refused:
        call()
    return str(refused.value)


def test_a_state_of_other_batches_or_taken_too_late_is_refused_in_one_line(mixture, tmp_path):
    dataset = open_dataset(mixture)
    first = TrainBatches(dataset, BatchPlan(8, 4, 1))
    next(first)
    state = first.state_dict()
    assert refusal(lambda: first.load_state_dict(state)) == (
        "load_state_dict must come before the first micro-batch is taken")
    first.close()
    assert refusal(lambda: next(first)).startswith("these TrainBatches are closed")
    other = open_dataset(DataConfig(remote=mixture.streams[0].remote))
    assert refusal(lambda: TrainBatches(other, BatchPlan(8, 4, 1)).load_state_dict(state)).startswith(
        "the state is of another dataset (")
    assert refusal(lambda: TrainBatches(dataset, BatchPlan(16, 4, 1)).load_state_dict(state)) == (
        "the state is of another global_batch_size (8, here 16): it cannot resume these batches")


def test_a_plan_that_does_not_fit_the_process_is_refused_in_one_line(mixture):
    assert refusal(lambda: TrainBatches(open_dataset(mixture), BatchPlan(8, 4, 2))) == (
        "the batch plan is for 2 ranks, but this process is one of 1 (WORLD_SIZE): give BatchPlan the world "
        "size torchrun started")
    assert BatchPlan(480, 12, 8).accumulation == 5 and BatchPlan(8, 2, 2).accumulation == 2
    assert refusal(lambda: BatchPlan(8, 3, 1)) == "global_batch_size 8 is not a multiple of micro_batch_size 3 x 1 ranks"
    assert refusal(lambda: BatchPlan(0, 4, 1)) == "global_batch_size must be a positive whole number, got 0"
    assert refusal(lambda: BatchPlan(8, -4, 1)) == "micro_batch_size must be a positive whole number, got -4"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="pins for real where CUDA is")
def test_pinning_without_cuda_warns_and_reads_on(mixture):
    with pytest.warns(UserWarning, match="pin_memory=True without CUDA"):
        batches = TrainBatches(open_dataset(mixture), BatchPlan(8, 4, 1), pin_memory=True)
    assert next(batches)["tokens"].shape == (4, 65)
    batches.close()


def test_the_start_up_line_and_the_checks_a_trainer_makes_on_relaunch(mixture, tmp_path):
    dataset = open_dataset(mixture)
    assert dataset.describe_epoch(BatchPlan(8, 4, 1)) == (
        "epochs of 11 steps: 88 samples: web 40 (45.5%, 1.00x its 40), books 48 (54.5%, 1.00x its 48)")
    dataset.check_resumes(dataset.identity)
    other = open_dataset(DataConfig(remote=mixture.streams[1].remote))
    assert refusal(lambda: other.check_resumes(dataset.identity)) == (
        "the dataset differs from the one the checkpoint was trained on; use a new run_dir")
    # What runs recorded before 2026-11-28 (metadata.json whole) is still this dataset, in a checkpoint or a state.
    dataset.check_resumes(dataset.former_identity)
    assert refusal(lambda: other.check_resumes(dataset.former_identity)).startswith("the dataset differs")
    plan = BatchPlan(8, 4, 1)
    batches = TrainBatches(dataset, plan)
    next(batches)
    state = {**batches.state_dict(), "dataset_identity": dataset.former_identity}
    want = next(batches)["ids"].tolist()
    batches.close()
    resumed = TrainBatches(open_dataset(mixture), plan)
    resumed.load_state_dict(state)
    assert next(resumed)["ids"].tolist() == want
    resumed.close()
    foreign = TrainBatches(other, plan)
    assert refusal(lambda: foreign.load_state_dict({**state, "dataset_identity": other.former_identity + "x"})) \
        .startswith("the state is of another dataset")
    foreign.close()


def test_evaluation_batches_leave_out_a_split_too_small_for_every_rank_in_one_line(mixture):
    loaders, left_out = eval_batches(open_dataset(mixture), 4, world_size=1)
    assert list(loaders) == ["web", "books"] and left_out == []
    assert [len(batch["ids"]) for batch in loaders["web"]] == [4, 4]  # the 8 val samples, unshuffled
    assert [batch["ids"].tolist() for batch in loaders["web"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    loaders, left_out = eval_batches(open_dataset(mixture), 6, world_size=2)
    assert loaders == {} and left_out == [
        f"evaluation of data.streams.{index} ({name}) is off: its val split has 8 samples, fewer than one "
        "micro-batch of 6 on each of 2 ranks" for index, name in enumerate(("web", "books"))]


def test_a_cache_limit_streaming_refuses_is_said_in_one_line(tmp_path):
    root = tiny_splits(tmp_path, 40, 8)
    message = refusal(lambda: TrainBatches(open_dataset(DataConfig(remote=str(root), local=str(tmp_path / "cache"),
                                                                    cache_limit="1kb")), BatchPlan(8, 4, 1)))
    assert message.startswith("data (train): ") and "\n" not in message, message


def test_a_closed_reader_gives_back_its_shared_memory_and_its_s3_data_opens_again(proxy, tmp_path):
    """Stock streaming keeps a dataset's shared-memory blocks (and 12 file descriptors) until the process exits,
    so a process that opens many readers (a run whose phases change data, a test process) ran out of file
    descriptors. close() gives them back, as does a reader that is dropped (once the threads that download ahead
    for it have ended: moments later); the same S3 data then opens again in the same order."""
    import gc
    import os
    from conftest import BUCKET
    from test_interruptions import upload

    from tokstream.reader.streaming_door import streaming_internals as internals
    from tokstream.reader.stale_shm import SHM_DIR

    root = tiny_splits(tmp_path, 40, 8)
    dataset = open_dataset(DataConfig(remote=upload(root, f"s3://{BUCKET}/reopened"), local=str(tmp_path / "cache")))

    def open_files() -> int:
        return len(os.listdir("/proc/self/fd"))

    def blocks() -> set[str]:
        return {path.name for path in SHM_DIR.iterdir()}

    seen, counts = None, []
    for round_ in range(4):
        batches = TrainBatches(dataset, BatchPlan(4, 2, 1))
        first = next(batches)["ids"].tolist()
        assert seen is None or first == seen  # the same order each time: the same data, opened again
        seen = first
        prefix = f"{internals.shm_prefix(batches.loader.dataset):06}_"  # this reader's, not a neighbour worker's
        mine = {name for name in blocks() if name.startswith(prefix)}
        if round_ == 3:
            del batches  # dropped, not closed: collected once streaming's download-ahead threads let it go
            deadline = time.monotonic() + 30
            while mine & blocks() and time.monotonic() < deadline:
                gc.collect()
                time.sleep(0.05)
        else:
            batches.close()
        counts.append(open_files())
        assert mine and not mine & blocks(), mine & blocks()  # this reader's blocks are gone from /dev/shm
    assert max(counts[1:]) <= counts[0]  # no descriptor kept per reader (stock kept 12 each)


def test_a_state_of_another_order_or_not_a_state_at_all_is_refused_in_one_line(mixture, tmp_path):
    """What decides the order travels with the state (weights, shuffle seed and algorithm, canonical nodes): a state
    of other weights or another seed is refused, not silently read in another order (stock streaming adopts the
    saved seed); a dict that is not a state (a trainer checkpoint's whole `loader`, a position off a step) is
    refused saying what a state is, not a KeyError at the first batch."""
    import dataclasses

    def weighted(web: float, books: float, **settings) -> DataConfig:
        streams = [dataclasses.replace(mixture.streams[0], proportion=web),
                   dataclasses.replace(mixture.streams[1], proportion=books)]
        return dataclasses.replace(mixture, streams=streams, **settings)

    def taken(config: DataConfig, micro_batches: int = 2) -> dict:
        batches = TrainBatches(open_dataset(config), BatchPlan(8, 4, 1))
        for _ in range(micro_batches):
            next(batches)
        state = batches.state_dict()
        batches.close()
        return state

    state = taken(weighted(0.3, 0.7))
    assert refusal(lambda: TrainBatches(open_dataset(weighted(0.9, 0.1)), BatchPlan(8, 4, 1)).load_state_dict(state)) == (
        "the state is of another mixture weights ([['proportion', 0.3], ['proportion', 0.7]], here "
        "[['proportion', 0.9], ['proportion', 0.1]]): it cannot resume these batches")
    seeded = taken(dataclasses.replace(mixture, shuffle_seed=1))
    assert refusal(lambda: TrainBatches(open_dataset(dataclasses.replace(mixture, shuffle_seed=2)),
                                        BatchPlan(8, 4, 1)).load_state_dict(seeded)) == (
        "the state is of another data.shuffle_seed (1, here 2): it cannot resume these batches")
    algorithm = dataclasses.replace(mixture, shuffle_algo="py1s")
    assert refusal(lambda: TrainBatches(open_dataset(algorithm), BatchPlan(8, 4, 1)).load_state_dict(
        taken(mixture))).startswith("the state is of another data.shuffle_algo ('py1e', here 'py1s')")
    # An older state without "format" still loads, its seed checked through streaming's own position.
    older = {key: seeded[key] for key in ("dataset_identity", "global_batch_size", "position")}
    assert refusal(lambda: TrainBatches(open_dataset(mixture), BatchPlan(8, 4, 1)).load_state_dict(older)) == (
        "the state is of another data.shuffle_seed (1, here 9176): it cannot resume these batches")
    resumed = TrainBatches(open_dataset(dataclasses.replace(mixture, shuffle_seed=1)), BatchPlan(8, 4, 1))
    resumed.load_state_dict(older)
    whole = TrainBatches(open_dataset(dataclasses.replace(mixture, shuffle_seed=1)), BatchPlan(8, 4, 1))
    expected = [next(whole)["ids"].tolist() for _ in range(4)][2:]
    assert [next(resumed)["ids"].tolist() for _ in range(2)] == expected
    resumed.close(), whole.close()

    fresh = TrainBatches(open_dataset(mixture), BatchPlan(8, 4, 1))
    loader = {"streams": {"key": taken(mixture)}, "consumed": {}}  # a trainer checkpoint's ["loader"]
    assert refusal(lambda: fresh.load_state_dict(loader)) == (
        "this is not a TrainBatches state (keys 'streams', 'consumed'): give what TrainBatches.state_dict() "
        "returned (a tokstream trainer's checkpoint holds its streams' states under ['loader']['streams'])")
    assert refusal(lambda: fresh.load_state_dict([1, 2])).startswith("this is not a TrainBatches state (a list)")
    off_step = dict(taken(mixture, micro_batches=1)["position"])  # streaming's position alone, half a step in
    assert refusal(lambda: fresh.load_state_dict(off_step)) == (
        "the position (sample 4 of its epoch) is not at a step of global_batch_size 8: it cannot resume these batches")
    good = taken(mixture)
    for damage in ({"sample_in_epoch": -2}, {"sample_in_epoch": 10**6}, {"epoch": 1.5}):
        damaged = {**good, "position": {**good["position"], **damage}}
        assert refusal(lambda: fresh.load_state_dict(damaged)).startswith("the state's position is damaged (epoch ")
    assert refusal(lambda: fresh.load_state_dict({**good, "shuffle_seed": "9176"})) == (
        "the state is of another data.shuffle_seed ('9176', here 9176): it cannot resume these batches")
    fresh.load_state_dict(good["position"])  # at a step: the trainer's states from before the reader API
    fresh.close()


def test_a_cache_holding_another_version_of_its_dataset_is_refused_not_read(tmp_path):
    """A local dataset read through a cache of its own (data.local): streaming copies its shards there and takes a
    shard present as downloaded, so after the dataset is converted again the cache would be read as the new one."""
    for name in ("first", "again"):
        (tmp_path / name).mkdir()
    data = tiny_splits(tmp_path / "first", 40, 8, seed=1)
    config = DataConfig(remote=str(data), local=str(tmp_path / "cache"))
    batches = TrainBatches(open_dataset(config), BatchPlan(8, 8, 1))
    next(batches)  # the shards are copied into the cache
    batches.close()
    data.rename(tmp_path / "first" / "old")
    tiny_splits(tmp_path / "again", 40, 8, seed=2).rename(data)  # converted again, in place
    assert refusal(lambda: open_dataset(config)) == (
        f"the cache {tmp_path / 'cache'} holds another version of {data} (its train/index.json differs from the "
        f"dataset's): empty {tmp_path / 'cache'}, or give the data a cache folder of its own")


def test_a_shuffle_streaming_does_not_know_is_refused_when_the_data_is_opened(mixture):
    """A typo would reach streaming only in the first epoch's order, a KeyError in a DataLoader worker."""
    import dataclasses

    assert refusal(lambda: open_dataset(dataclasses.replace(mixture, shuffle_algo="feistel"))) == (
        "data.shuffle_algo='feistel' is not a shuffle streaming knows: give auto or one of feistel_window, lazy, naive, py1br, "
        "py1e, py1s, py2s")
