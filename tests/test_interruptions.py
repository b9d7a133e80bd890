"""A random interruption schedule against an uninterrupted run, through real torchrun.

A run of 16 steps over a 44-sample split (epochs of 5 steps: 3 epoch ends, a checkpoint at each) is
interrupted five ways, in random order at random steps: SIGTERM to torchrun, SIGUSR1 to one rank,
SIGTERM during an evaluation, SIGKILL right after an epoch-end checkpoint, SIGKILL while a
checkpoint is being uploaded. Each relaunch switches between 2 ranks and 1 (both directions,
repeatedly) with a random micro-batch. run_dir is in S3 (moto's server behind the test proxy, which
can hold an upload for the kill), and each launch gets an empty run_local, as on a new machine.

Per step, the interrupted run must consume the uninterrupted run's samples (per rank while on 2
ranks), with its learning rate exactly and its loss bitwise until the first relaunch on other
settings, to float rounding after (the reduction order changes). The seed is printed;
TOKSTREAM_INTERRUPTION_SEED=N repeats a schedule.
"""

import json
import os
import random
import signal
import time

import pytest
from conftest import BUCKET
from test_training import kill_tree, launch, metrics, tiny_splits, train, wait_for, worker_pids

from tokstream.train.run_store import S3RunStore

EPOCH_STEPS = 5  # 44 samples at 8 per step: epochs of 40
MICRO_BATCHES = {2: (1, 2, 4), 1: (2, 4, 8)}  # ranks -> micro-batch sizes that divide the global batch of 8
KINDS = ("SIGTERM to torchrun", "SIGUSR1 to one rank", "SIGTERM during evaluation",
         "SIGKILL after an epoch-end checkpoint", "SIGKILL during a checkpoint upload")


def next_epoch_end(step: int) -> int:
    return (step // EPOCH_STEPS + 1) * EPOCH_STEPS


def test_a_random_interruption_schedule_resumes_exactly(proxy, tmp_path):
    seed = int(os.environ.get("TOKSTREAM_INTERRUPTION_SEED", random.randrange(1_000_000)))
    print(f"interruption schedule: TOKSTREAM_INTERRUPTION_SEED={seed}")
    rng = random.Random(seed)
    data = tiny_splits(tmp_path, 44, 2000)
    common = [f"checkpoint_interval={EPOCH_STEPS}", "eval_interval=0"]
    train(2, data, tmp_path / "reference", *common)
    reference = metrics(tmp_path / "reference")

    run_dir = f"s3://{BUCKET}/runs/interrupted-{seed}"
    store = S3RunStore(run_dir, tmp_path / "reader")

    def latest() -> int:
        pointer = store.read_bytes("LATEST")
        return json.loads(pointer)["step"] if pointer else 0

    resume, ranks, bitwise_until, schedule = 0, 2, 0, []
    for number, kind in enumerate(rng.sample(KINDS, len(KINDS))):
        micro = 4 if number == 0 else rng.choice(MICRO_BATCHES[ranks])
        local = tmp_path / f"launch{number}"
        settings = [*common, f"micro_batch_size={micro}", f"run_local={local}"]
        at = {"SIGTERM during evaluation": resume + 2, "SIGKILL after an epoch-end checkpoint": next_epoch_end(resume),
              "SIGKILL during a checkpoint upload": next_epoch_end(resume)}.get(kind, resume + rng.randint(1, 2))
        if kind == "SIGTERM during evaluation":
            settings += [f"eval_interval={at}", "eval_batches=100000"]  # the whole 2,000-sample split: seconds
        if kind == "SIGKILL during a checkpoint upload":
            proxy.hold("PUT", f"/ckpt-{at:08d}.pt", seconds=120)
        process = launch(ranks, data, run_dir, *settings)
        steps_here = lambda: len(metrics(local))  # noqa: E731  (this launch's steps, after the resumed ones)
        if kind == "SIGKILL after an epoch-end checkpoint":
            wait_for(lambda: latest() == at)
            kill_tree(process.pid)
        elif kind == "SIGKILL during a checkpoint upload":
            wait_for(proxy.holding.is_set)  # training goes on meanwhile: the save is in the background
            kill_tree(process.pid)
        else:
            wait_for(lambda: steps_here() >= (at - 1 if kind == "SIGTERM during evaluation" else at))
            if kind == "SIGTERM during evaluation":
                time.sleep(0.3)  # step `at` takes milliseconds, its evaluation seconds
            if kind == "SIGUSR1 to one rank":
                os.kill(worker_pids(process.pid)[-1], signal.SIGUSR1)
            else:
                process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=120)
        proxy.clear()
        stopped = latest()
        schedule.append(f"{ranks} rank(s) x {micro}: {kind} at step {at} -> resumes at {stopped}")
        where = f"seed {seed}, {schedule[-1]}\n" + output[-3000:]
        if kind.startswith("SIGKILL"):
            assert process.returncode != 0, where
        else:
            assert "preempted" in output and process.returncode != 0, where
        if kind == "SIGTERM during evaluation":
            assert f"evaluation at step {at} stopped: preemption notice" in output, where
        if kind == "SIGKILL after an epoch-end checkpoint":
            assert stopped == at, where
        if kind == "SIGKILL during a checkpoint upload":
            assert stopped == resume and f"ckpt-{at:08d}.pt" not in store.names(), where  # never visible
        if number == 0:
            bitwise_until = stopped  # the steps trained on the reference's own settings
        resume, ranks = stopped, 3 - ranks

    micro = rng.choice(MICRO_BATCHES[ranks])
    schedule.append(f"{ranks} rank(s) x {micro}: to the end")
    output = train(ranks, data, run_dir, *common, f"micro_batch_size={micro}", f"run_local={tmp_path / 'last'}")
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
