"""Jobs that start on one node at the same moment each get their own streaming shared memory.

Stock streaming numbers a dataset's shared-memory blocks by scanning for the lowest free number in
every rank; jobs that start together pick the same one and one of them dies at start
(FileExistsError, or "not registered by local leader"). prefix_registration.py claims the number
once per node, atomically. Several 2-rank jobs (real processes, gloo groups) are released at the
same instant, as a scheduler starting a sweep would.
"""

import subprocess
import sys
import time

from conftest import ROOT

JOB_RANK = """
import os, sys, time
job, rank, world, store, go, data = sys.argv[1:]
os.environ.update(RANK=rank, WORLD_SIZE=world, LOCAL_WORLD_SIZE=world, LOCAL_RANK=rank)
import torch.distributed as dist
from tokstream.train.config import DataConfig
from tokstream.train.data import make_loader
from tokstream.train.streaming_internals import shm_prefix
dist.init_process_group("gloo", init_method=f"file://{store}", rank=int(rank), world_size=int(world))
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.0005)
loader = make_loader(DataConfig(remote=data), "train", batch_size=4, shuffle=True, pin_memory=False, num_workers=0)
print(shm_prefix(loader.dataset), next(iter(loader))["ids"].tolist(), flush=True)
sys.stdin.readline()  # hold the blocks until every job has registered
"""

JOBS, RANKS = 3, 2


def test_jobs_started_together_each_register_their_own_prefix(dataset, tmp_path):
    go = tmp_path / "go"
    processes = {(job, rank): subprocess.Popen(
        [sys.executable, "-c", JOB_RANK, str(job), str(rank), str(RANKS), str(tmp_path / f"store{job}"), str(go),
         str(dataset)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for job in range(JOBS) for rank in range(RANKS)}
    try:
        for process in processes.values():
            assert process.stdout.readline() == "ready\n", process.communicate(timeout=60)[1][-2000:]
        time.sleep(0.2)  # every process is polling now
        go.touch()
        reports = {key: process.stdout.readline().split(" ", 1) for key, process in processes.items()}
    finally:
        outcomes = {key: process.communicate("done\n", timeout=120) for key, process in processes.items()}
    failures = {key: err.strip().splitlines()[-1:] for key, (_, err) in outcomes.items() if processes[key].returncode}
    assert not failures, failures
    prefixes = {key: int(prefix) for key, (prefix, _) in reports.items()}
    for job in range(JOBS):  # one prefix per job, another for each job
        assert prefixes[job, 0] == prefixes[job, 1]
    assert len({prefixes[job, 0] for job in range(JOBS)}) == JOBS
    # Each job reads what it would read alone: the same seed's batches, partitioned over its ranks.
    first_batches = {key: ids for key, (_, ids) in reports.items()}
    assert len({first_batches[job, 0] for job in range(JOBS)}) == 1
    assert len({first_batches[job, 1] for job in range(JOBS)}) == 1
    assert first_batches[0, 0] != first_batches[0, 1]
