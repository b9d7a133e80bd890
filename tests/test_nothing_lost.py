"""Nothing a run wrote is lost to the project's own safety machinery, through real torchrun and the
real S3 server: a run without its LATEST or with a corrupt newest checkpoint resumes from the newest
one that passes its checks; a second job on a live run_dir refuses; ranks do not outlive their
launcher; a relaunch never starts over from step 0 by itself. (The files' own rules: test_checkpoint.py.)"""

import os
import signal
import time

import pytest
import test_training as training
from conftest import BUCKET
from test_checkpoint import flip_bytes
from test_s3 import plays_on_s3  # noqa: F401 (a fixture)

from tokstream.object_store import S3Dataset
from tokstream.testing.processes import worker_pids
from tokstream.train.checkpoint_files import latest_step
from tokstream.train.run_store import LocalRunStore, S3RunStore

FAST_LEASE = "lease_interval_s=0.5"  # a launch watches a lease for 3 beats before it takes it over


def test_an_s3_run_without_latest_and_a_corrupt_newest_checkpoint_resumes_exactly_from_the_one_before(
        reference, plays_on_s3, s3, tmp_path):
    """Checkpoints 4, 8 and 12 in S3; LATEST removed (a copy to a new prefix without it) and 64 bytes of
    ckpt-12 flipped (it still loads: only its checksum tells). The relaunch says both in one line each
    (once, not per rank), resumes from ckpt-8, and trains on the uninterrupted run's samples with its
    losses, bitwise."""
    run_dir = f"s3://{BUCKET}/runs/no-latest"
    store = S3Dataset(run_dir)
    local = [f"data.local={tmp_path / 'cache'}", f"run_local={tmp_path / 'run'}"]
    training.train(2, plays_on_s3, run_dir, *local, "max_steps=12")
    assert latest_step(S3RunStore(run_dir, tmp_path / "reader")) == 12
    store.delete(["LATEST"])
    store.put_bytes("ckpt-00000012.pt", flip_bytes(store.get_bytes("ckpt-00000012.pt")))

    output = training.train(2, plays_on_s3, run_dir, *local)
    assert output.count(f"warning: {run_dir}/ckpt-00000012.pt not used: its xxh3_128 checksum differs from its "
                        "manifest's; falling back to the checkpoint before it") == 1
    assert output.count(f"LATEST in {run_dir} is missing: resuming from the newest checkpoint that passes its "
                        "checks, ckpt-00000008.pt") == 1
    assert f"resumed from {run_dir}/ckpt-00000008.pt at step 8" in output
    assert "removed" not in output
    assert training.trained_steps(run_dir) == reference


@pytest.mark.long
def test_a_second_job_on_a_live_run_refuses_in_one_line_and_the_live_job_goes_on(dataset, proxy, tmp_path):
    """Job A trains; job B is launched on the same run_dir: B finds A's lease, held by a process that
    runs, refuses in one line naming A, and writes nothing. A goes on and, preempted, saves and gives
    its lease back. In S3 (a local run_dir keeps its lease through the same store interface:
    test_run_lease.py). A's store is slow meanwhile (its step 8 upload answered 15 s late: from step 12 A waits
    for it, live and beating its lease), which leaves B's start-up the CPU A would have trained on."""
    run_dir = f"s3://{BUCKET}/runs/live-{os.getpid()}"
    store = S3RunStore(run_dir, tmp_path / "reader")
    proxy.slow("PUT", f"/runs/live-{os.getpid()}/ckpt-00000008.pt", seconds=15)
    job_a = training.launch(2, dataset, run_dir, FAST_LEASE, "max_steps=400", "optim.decay_steps=400",
                            f"run_local={tmp_path / 'a'}")
    training.wait_for(lambda: (latest_step(store) or 0) >= 4)
    job_b = training.launch(2, dataset, run_dir, FAST_LEASE, "max_steps=400", "optim.decay_steps=400",
                            f"run_local={tmp_path / 'b'}")
    refused = job_b.communicate(timeout=120)[0]
    proxy.clear()
    assert job_b.returncode != 0 and job_a.poll() is None
    refusal = [line for line in refused.splitlines() if line.startswith("error:")]
    assert len(refusal) == 1 and refusal[0].startswith(f"error: {run_dir} is in use by a live job (host "), refused
    assert f"PID {worker_pids(job_a.pid)[0]}, since " in refusal[0]
    assert refusal[0].endswith("its process is running on this machine): stop that job first, or point run_dir "
                               "elsewhere")  # another machine's live job: its lease moving (test_run_lease.py)
    assert "resumed from" not in refused and not (tmp_path / "b" / "metrics.jsonl").exists()

    written_by_a = tmp_path / "a"  # an S3 run's metrics as written, in its run_local
    steps_then = len(training.metrics(written_by_a))
    training.wait_for(lambda: len(training.metrics(written_by_a)) > steps_then + 2)
    job_a.send_signal(signal.SIGTERM)
    output = job_a.communicate(timeout=120)[0]
    assert job_a.returncode != 0 and "preempted (signal 15)" in output, output[-2000:]
    assert "LEASE" not in store.names()  # given back on the way out


def test_ranks_exit_when_torchruns_agent_is_killed_and_the_relaunch_resumes_at_once(reference, dataset, tmp_path):
    """kill -9 of torchrun's process group (the agent only: each rank has a session of its own): the
    ranks exit within seconds, writing nothing more; the relaunch finds their lease's holder gone from
    this machine, takes it without waiting, and finishes on the uninterrupted run's samples and losses.
    A relaunch asking for fewer steps than the run has taken is refused in one line."""
    job = training.launch(2, dataset, tmp_path, "lease_interval_s=30")  # a live lease would hold a relaunch 90 s
    store = LocalRunStore(tmp_path)
    training.wait_for(lambda: (latest_step(store) or 0) >= 4 and len(worker_pids(job.pid)) == 2)
    ranks = worker_pids(job.pid)
    os.killpg(job.pid, signal.SIGKILL)
    job.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") for pid in ranks):
        assert time.monotonic() < deadline, "ranks outlived their launcher by 10 s"
        time.sleep(0.1)
    written = sorted((p.name, p.stat().st_size) for p in tmp_path.iterdir())
    time.sleep(1.5)
    assert sorted((p.name, p.stat().st_size) for p in tmp_path.iterdir()) == written  # nothing more written

    began = time.monotonic()
    output = training.train(2, dataset, tmp_path, "lease_interval_s=30")
    assert "has a lease" not in output and time.monotonic() - began < 85
    assert training.trained_steps(tmp_path) == reference

    shorter = training.launch(2, dataset, tmp_path, "max_steps=8", warm=True)
    said = shorter.communicate(timeout=120)[0]
    assert shorter.returncode != 0
    assert [line for line in said.splitlines() if line.startswith("error:")] == [
        f"error: max_steps=8 is below the step of {tmp_path}/ckpt-00000016.pt, 16: raise max_steps, or point run_dir "
        "elsewhere"]
    assert training.trained_steps(tmp_path) == reference
