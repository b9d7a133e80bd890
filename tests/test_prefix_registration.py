"""Jobs that start on one node at the same moment each get their own streaming shared memory.

Stock streaming numbers a dataset's shared-memory blocks by scanning for the lowest free number in
every rank; jobs that start together pick the same one and one of them dies at start
(FileExistsError, or "not registered by local leader"). prefix_registration.py claims the number
once per node, atomically. Several 2-rank jobs (real processes, gloo groups) start together, and
their first ranks' first scans are made to agree, so that they certainly collide: each of them
then tries to claim the same number, as jobs that a scheduler starts in a sweep can.
"""

import json
import os
import shlex
import subprocess
import sys
import threading
import time

import pytest
from conftest import ROOT, namespaces_permitted
from warm_ranks import WarmPython

JOB_RANK = """
import json, os, sys, time
from pathlib import Path
job, rank, world, store, scans_dir, data, jobs = sys.argv[1:]
os.environ.update(RANK=rank, WORLD_SIZE=world, LOCAL_WORLD_SIZE=world, LOCAL_RANK=rank)
import torch.distributed as dist
from tokstream.reader.streaming_door import streaming_internals as internals
from tokstream.reader.config import DataConfig
from tokstream.reader.batches import make_loader

scan, scans = internals.first_free_prefix, []

def agreed_scan(*args):
    # Stock's scan, which the first rank runs before it claims a number. Its first call is repeated, in
    # rounds, until every job's first rank found the same number (another test may take or free one
    # between their scans): then they all try to claim that one, a collision whatever the scheduling.
    # Every first rank waits for all the others' scan of each round (the test's watchdog ends a hang), so
    # all decide each round alike.
    if scans:
        scans.append(scan(*args))
        return scans[-1]
    for round in range(1000):
        prefix = scan(*args)
        mine = Path(scans_dir, f"{round}-{job}.scan")
        mine.with_suffix(".tmp").write_text(str(prefix))
        mine.with_suffix(".tmp").rename(mine)  # whole, as the others read it
        while len(found := list(Path(scans_dir).glob(f"{round}-*.scan"))) < int(jobs):
            time.sleep(0.001)
        if {path.read_text() for path in found} == {str(prefix)}:
            scans.append(prefix)
            return prefix
    raise RuntimeError("the jobs' first ranks never found the same free prefix")

internals.first_free_prefix = agreed_scan
dist.init_process_group("gloo", init_method=f"file://{store}", rank=int(rank), world_size=int(world))
loader = make_loader(DataConfig(remote=data), "train", batch_size=4, shuffle=True, pin_memory=False, num_workers=0)
print(json.dumps([internals.shm_prefix(loader.dataset), scans, next(iter(loader))["ids"].tolist()]), flush=True)
sys.stdin.readline()  # hold the blocks until every job has registered
"""

JOBS, RANKS = 3, 2


def test_jobs_started_together_each_register_their_own_prefix(dataset, tmp_path):
    (tmp_path / "scans").mkdir()
    processes = {(job, rank): WarmPython("-c", JOB_RANK, job, rank, RANKS, tmp_path / f"store{job}", tmp_path / "scans",
                                         dataset, JOBS, cwd=ROOT)
                 for job in range(JOBS) for rank in range(RANKS)}
    # A hang fails the test, not the suite.
    watchdog = threading.Timer(300, lambda: [process.kill() for process in processes.values()])
    watchdog.start()
    try:
        lines = {key: process.stdout.readline() for key, process in processes.items()}  # "" if killed
    finally:
        watchdog.cancel()
        outcomes = {key: process.communicate("done\n", timeout=120) for key, process in processes.items()}
    failures = {key: (processes[key].returncode, err.strip().splitlines()[-1:]) for key, (_, err) in outcomes.items()
                if processes[key].returncode}
    assert not failures, failures
    reports = {key: json.loads(line) for key, line in lines.items()}
    prefixes = {key: prefix for key, (prefix, _, _) in reports.items()}
    for job in range(JOBS):  # one prefix per job, another for each job
        assert prefixes[job, 0] == prefixes[job, 1]
    assert len({prefixes[job, 0] for job in range(JOBS)}) == JOBS
    # They collided: every first rank tried the same number first, and all but one had to scan again.
    scans = [reports[job, 0][1] for job in range(JOBS)]
    assert len({tried[0] for tried in scans}) == 1 and sum(len(tried) > 1 for tried in scans) >= JOBS - 1, scans
    assert all(reports[job, 1][1] == [] for job in range(JOBS))  # the other ranks take the claimed number
    # Each job reads what it would read alone: the same seed's batches, partitioned over its ranks.
    first_batches = {key: json.dumps(ids) for key, (_, _, ids) in reports.items()}
    assert len({first_batches[job, 0] for job in range(JOBS)}) == 1
    assert len({first_batches[job, 1] for job in range(JOBS)}) == 1
    assert first_batches[0, 0] != first_batches[0, 1]


def in_a_node_of_its_own(script: str, dataset, tmp_path) -> dict:
    """The JSON a Python `script` (given the dataset) prints last, run with a /dev/shm and temp directory of its own,
    so that the shared-memory prefixes are its alone."""
    (tmp_path / "tmp").mkdir()
    command = shlex.join([sys.executable, "-c", script, str(dataset)])
    done = subprocess.run(["unshare", "--ipc", "--mount", "--propagation", "private", "sh", "-c",
                           f"mount -t tmpfs node-shm /dev/shm && {command}"], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path / "tmp")), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


LEFTOVER = """
import json, sys
from multiprocessing.shared_memory import SharedMemory
from tokstream.reader import BatchPlan, DataConfig, TrainBatches, open_dataset

dataset = open_dataset(DataConfig(remote=sys.argv[1]))
live = TrainBatches(dataset, BatchPlan(4, 4, 1))  # prefix 0, not yet read nor resumed: no lock files, no resume block
# Prefix 1's resume block, all that is left of a job whose rank that created it is still releasing it.
state = json.dumps({"epoch": 0, "sample_in_epoch": 40, "num_canonical_nodes": 1, "shuffle_seed": 9176,
                    "initial_physical_nodes": 1}).encode()
leftover = SharedMemory("000001_resume", create=True, size=len(state))
leftover.buf[:len(state)] = state
fresh = TrainBatches(dataset, BatchPlan(4, 4, 1))
seen = [next(live)["ids"].tolist() for _ in range(11)]
print(json.dumps({"first": seen[0], "eleventh": seen[10], "fresh": next(fresh)["ids"].tolist()}))
fresh.close(), live.close()
leftover.close(), leftover.unlink()
"""


@pytest.mark.skipif(not namespaces_permitted(), reason="namespaces are not permitted here (unshare --ipc --mount)")
def test_a_new_reader_takes_no_prefix_where_another_datasets_block_is_left(dataset, tmp_path):
    """Datasets release their blocks when they close, each process those it created, so a job's first rank may
    be done while another rank still holds a block of its prefix. A new reader must not take that prefix:
    stock's scan (per kind of block, the largest lowest-free) took it whenever a lower live prefix lacked that
    kind, and the new reader then read the other's resume state and started mid-epoch. In a /dev/shm and
    temp directory of its own, so that the prefixes are these alone."""
    read = in_a_node_of_its_own(LEFTOVER, dataset, tmp_path)
    assert read["fresh"] == read["first"] != read["eleventh"]


RACE = """
import json, os, sys
from multiprocessing.shared_memory import SharedMemory
from tokstream.reader import BatchPlan, DataConfig, TrainBatches, open_dataset
from tokstream.reader.streaming_door import streaming_internals as internals

scan = internals.first_free_prefix
leftover = SharedMemory("000000_next_epoch", create=True, size=8)  # a block of another dataset, still held
calls = []

def raced(*args):  # the first scan saw prefix 0 free: the block appeared just after it
    calls.append(scan(*args) if calls else 0)
    return calls[-1]

internals.first_free_prefix = raced
batches = TrainBatches(open_dataset(DataConfig(remote=sys.argv[1])), BatchPlan(4, 4, 1))
print(json.dumps({"calls": calls, "prefix": internals.shm_prefix(batches.loader.dataset),
                  "left": sorted(name for name in os.listdir("/dev/shm") if name.startswith("000000_"))}))
batches.close()
leftover.close(), leftover.unlink()
"""


@pytest.mark.skipif(not namespaces_permitted(), reason="namespaces are not permitted here (unshare --ipc --mount)")
def test_a_prefix_where_a_block_appears_between_scan_and_claim_is_given_up(dataset, tmp_path):
    read = in_a_node_of_its_own(RACE, dataset, tmp_path)
    assert read == {"calls": [0, 1], "prefix": 1, "left": ["000000_next_epoch"]}  # its claim on 0 taken back


def test_a_rank_attaching_to_a_block_its_creator_has_not_sized_yet_waits_for_it(monkeypatch):
    """Every rank of a node creates a dataset's barrier and arrays (streaming's SharedMemory with create=None), and
    attaches, 7 ms later, where another rank created the block first. A creator descheduled between creating and
    sizing the block (a loaded node) left it empty, and the attach failed with "cannot mmap an empty file": a job
    of three started together died that way in CI. Here the creator stops 0.3 s before sizing it."""
    import _posixshmem

    from tokstream.reader import streaming_door
    from tokstream.reader.streaming_door import streaming_internals as internals

    streaming_door.install()
    name = f"tokstream-test-unsized-{os.getpid()}"
    fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)

    def size_it_late():
        time.sleep(0.3)
        os.ftruncate(fd, 8)
        os.pwrite(fd, b"written!", 0)

    creator = threading.Thread(target=size_it_late)
    try:
        creator.start()
        attached = internals.SharedMemory(name, None, 8, auto_cleanup=False)
        creator.join()
        assert bytes(attached.buf[:8]) == b"written!"
        attached.shm.close()
        os.ftruncate(fd, 0)  # a creator that never sizes it: the attach gives up, with stock's error
        monkeypatch.setattr(internals, "SIZING_WAIT_S", 0.05)
        with pytest.raises(ValueError, match="empty file"):
            internals.SharedMemory(name, None, 8, auto_cleanup=False)
    finally:
        creator.join()
        os.close(fd)
        _posixshmem.shm_unlink("/" + name)
