"""A random interruption schedule against an uninterrupted run, through real torchrun.

A run of 16 steps over a 44-sample split (epochs of 5 steps: 3 epoch ends, a checkpoint at each) is
interrupted five ways, in random order at random steps: SIGTERM to torchrun, SIGUSR1 to one rank,
SIGTERM during an evaluation, SIGKILL right after an epoch-end checkpoint, SIGKILL while a
checkpoint is being uploaded. The first two launches keep the uninterrupted run's settings (2 ranks
x 4 samples; the second with DataLoader workers and deterministic=true, the GPU setting, which must
not change a CPU run); from then on each relaunch switches between 1 rank and 2 (both directions)
with a random micro-batch. Dataset and run_dir are in S3 (moto's server behind the test proxy, which
can hold an upload for the kill), and every launch starts with an empty data cache and run_local,
as on a new machine.

Per step, the interrupted run must consume the uninterrupted run's samples (per rank while on 2
ranks), with its learning rate exactly, and its loss bitwise while the settings are the
reference's and to float rounding after (the reduction order changes). The seed is printed;
TOKSTREAM_INTERRUPTION_SEED=N repeats a schedule.
"""

import os
import random
import re
import signal
import time

import pytest
from conftest import BUCKET, ROOT
from test_training import BASE, launch, metrics, tiny_splits, train, wait_for

from tokstream.errors import UserError
from tokstream.object_store import S3Dataset
from tokstream.testing.processes import kill_tree, worker_pids
from tokstream.train.checkpoint import latest_step
from tokstream.train.run_store import S3RunStore

EPOCH_STEPS = 5  # 44 samples at 8 per step: epochs of 40
MICRO_BATCHES = {2: (1, 2, 4), 1: (2, 4, 8)}  # ranks -> micro-batch sizes that divide the global batch of 8
KINDS = ("SIGTERM to torchrun", "SIGUSR1 to one rank", "SIGTERM during evaluation",
         "SIGKILL after an epoch-end checkpoint", "SIGKILL during a checkpoint upload")
COMMON = (f"checkpoint_interval={EPOCH_STEPS}", "eval_interval=0")


def next_epoch_end(step: int) -> int:
    return (step // EPOCH_STEPS + 1) * EPOCH_STEPS


def upload(root, url: str) -> str:
    store = S3Dataset(url)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        store.upload(path, path.relative_to(root).as_posix())
    return url


def launch_settings(number: int, ranks: int, rng: random.Random, machine) -> list[str]:
    """A relaunch's settings: the reference's for the first two, then a random micro-batch; always a new machine."""
    settings = [*COMMON, f"data.local={machine / 'cache'}", f"run_local={machine / 'run'}"]
    if number == 0:
        return settings + ["micro_batch_size=4"]
    if number == 1:
        return settings + ["micro_batch_size=4", "data.num_workers=2", "deterministic=true"]
    return settings + [f"micro_batch_size={rng.choice(MICRO_BATCHES[ranks])}"]


def test_a_random_interruption_schedule_resumes_exactly(proxy, tmp_path):
    seed = int(os.environ.get("TOKSTREAM_INTERRUPTION_SEED", random.randrange(1_000_000)))
    print(f"interruption schedule: TOKSTREAM_INTERRUPTION_SEED={seed}")
    rng = random.Random(seed)
    local_data = tiny_splits(tmp_path, 44, 2000)
    train(2, local_data, tmp_path / "reference", *COMMON)
    reference = metrics(tmp_path / "reference")
    data = upload(local_data, f"s3://{BUCKET}/interruptions-{seed}")
    run_dir = f"s3://{BUCKET}/runs/interrupted-{seed}"
    store = S3RunStore(run_dir, tmp_path / "reader")

    def latest() -> int:
        return latest_step(store) or 0

    resume, ranks, bitwise_until, schedule = 0, 2, 0, []
    for number, kind in enumerate(rng.sample(KINDS, len(KINDS))):
        machine = tmp_path / f"machine{number}"
        settings = launch_settings(number, ranks, rng, machine)
        at = {"SIGTERM during evaluation": resume + 2, "SIGKILL after an epoch-end checkpoint": next_epoch_end(resume),
              "SIGKILL during a checkpoint upload": next_epoch_end(resume)}.get(kind, resume + rng.randint(1, 2))
        if kind == "SIGTERM during evaluation":
            settings += [f"eval_interval={at}", "eval_batches=100000",  # the whole 2,000-sample split: seconds
                         "preempt_grace_s=0.01"]  # and a grace period no save fits in
        if kind == "SIGKILL during a checkpoint upload":
            proxy.hold("PUT", f"/ckpt-{at:08d}.pt", seconds=120)
        process = launch(ranks, data, run_dir, *settings)
        if kind == "SIGKILL after an epoch-end checkpoint":
            wait_for(lambda: latest() >= at)
            kill_tree(process.pid)
        elif kind == "SIGKILL during a checkpoint upload":
            wait_for(proxy.holding.is_set)  # training goes on meanwhile: the save is in the background
            kill_tree(process.pid)
        else:
            steps_here = lambda: len(metrics(machine / "run"))  # noqa: E731  (the resumed steps, then this launch's)
            wait_for(lambda: steps_here() >= (at - 1 if kind == "SIGTERM during evaluation" else at))
            if kind == "SIGTERM during evaluation":
                time.sleep(0.3)  # step `at` takes milliseconds, its evaluation seconds
            if kind == "SIGUSR1 to one rank":
                os.kill(worker_pids(process.pid)[-1], signal.SIGUSR1)  # e.g. Slurm --signal; the others follow
            else:
                process.send_signal(signal.SIGTERM)  # torchrun forwards it to every rank
        output, _ = process.communicate(timeout=120)
        proxy.clear()
        stopped = latest()
        schedule.append(f"{ranks} rank(s), {' '.join(settings[4:])}: {kind} at step {at} -> resumes at {stopped}")
        where = f"seed {seed}, {schedule[-1]}\n" + output[-3000:]
        assert process.returncode != 0, where  # unfinished, whichever way: a scheduler requeues it
        if kind in ("SIGTERM to torchrun", "SIGUSR1 to one rank"):
            assert re.search(r"preempted \(signal.*\): saved checkpoint at step \d+ in [\d.]+ s, [\d.]+ s after the "
                             r"notice: within preempt_grace_s=30", output), where
        if kind == "SIGTERM during evaluation":
            assert f"evaluation at step {at} stopped: preemption notice" in output, where
            assert "warning: a preemption notice would end in a kill: a step" in output, where  # said at start-up
            assert re.search(r"s after the notice: PAST preempt_grace_s=0.01", output), where
        if kind == "SIGKILL after an epoch-end checkpoint":
            assert stopped == at, where
        if kind == "SIGKILL during a checkpoint upload":
            assert stopped == resume and f"ckpt-{at:08d}.pt" not in store.names(), where  # never visible
        if number < 2:
            bitwise_until = stopped  # trained on the reference's own settings so far
        resume, ranks = stopped, (2 if number == 0 else 3 - ranks)

    refused_recipe(run_dir, data, tmp_path)
    micro = rng.choice(MICRO_BATCHES[ranks])
    schedule.append(f"{ranks} rank(s), micro_batch_size={micro}: to the end")
    output = train(ranks, data, run_dir, *COMMON, f"micro_batch_size={micro}", f"data.local={tmp_path / 'last'}",
                   f"run_local={tmp_path / 'last-run'}")
    assert f"resumed from {run_dir}/ckpt-{resume:08d}.pt" in output

    interrupted = metrics(run_dir)  # the copy uploaded with the final checkpoint
    print("\n".join(schedule))
    assert [m["step"] for m in interrupted] == [m["step"] for m in reference] == list(range(1, 17))
    for got, want in zip(interrupted, reference):
        where = f"seed {seed}, step {got['step']}:\n" + "\n".join(schedule)
        assert sorted(sum(got["samples"], [])) == sorted(sum(want["samples"], [])), where
        if len(got["samples"]) == 2:
            assert got["samples"] == want["samples"], where
        assert got["lr"] == want["lr"], where
        if got["step"] <= bitwise_until:
            assert got["loss"] == want["loss"], where
        else:
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-4), where


def refused_recipe(run_dir: str, data: str, tmp_path) -> None:
    """A relaunch that changes the recipe is refused before anything is built (what train/main.py runs
    first; that such errors reach the console as one line through torchrun: test_training.py)."""
    from tokstream.train.config import load_config
    from tokstream.train.trainer import setup

    store = S3RunStore(run_dir, tmp_path / "reader")
    before = store.names()
    config = load_config(str(ROOT / BASE[0]), [*BASE[1:], *COMMON, f"data.remote={data}", f"run_dir={run_dir}",
                                               f"data.local={tmp_path / 'refused'}", "optim.lr=0.001"])
    with pytest.raises(UserError, match=re.escape("optim.lr changed from 0.003 to 0.001 since the checkpoint: a "
                                                  "resumed run keeps its recipe; use a new run_dir, or add "
                                                  "resume_allow=[optim.lr]")):
        setup(config)
    assert store.names() == before
