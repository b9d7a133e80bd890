"""A random interruption schedule against an uninterrupted run, through real torchrun, on a mixture.

The data is a mixture of two sources (mixture.py), the general case of which a single dataset is
the one-source instance: "web", 20 samples at repeat 1.5, and "books", 30 samples of which 14 are
chosen per epoch. That is 44 samples an epoch, cut to 40 whole steps: web 27 (one full pass plus a
different 7 each epoch), books 13 (a different 13 each epoch), the per-epoch resampling where
streaming has had resumption bugs. A run of 16 steps (epochs of 5 steps: 3 epoch ends, a checkpoint
at each) is interrupted five ways, in random order at random steps: SIGTERM to torchrun, SIGUSR1 to one rank,
SIGTERM during an evaluation, SIGKILL right after an epoch-end checkpoint, SIGKILL while a
checkpoint is being uploaded. Launches keep the uninterrupted run's settings (2 ranks x 4 samples;
after the first, with DataLoader workers and deterministic=true, the GPU setting, which must not
change a CPU run) until one has resumed on them and trained on: the second, or the third where a
kill during an upload left the second nothing to resume from or undid its steps. From then on each
relaunch switches between 1 rank and 2 (both directions) with a random micro-batch. Dataset and
run_dir are in S3 (moto's server behind the test proxy, which can hold an upload for the kill). A
launch after a SIGTERM starts on a new machine, with an empty data cache and run_local; a launch
after a SIGKILL (node-level kill, cgroup OOM) on the killed run's machine, where its cache,
run_local and streaming's shared memory were left behind: the stale blocks, which make stock
streaming refuse to start ("Reused local directory"), must be removed at start. (That another job's
blocks stay, and a stale block another process maps goes: test_training.py, test_stale_shm.py.)

Per step, the interrupted run must consume the uninterrupted run's samples (per rank while on 2
ranks) and count the same samples per source, with its learning rate exactly. Its loss must be
bitwise on every step trained on the reference's world size and micro-batch (workers and
deterministic=true change no bit), from step 1 up to the first step trained on other settings: those
sum the gradients in another order (one rank's micro-batches instead of two ranks' all-reduce, or
other micro-batches' means), so from there on the weights differ in their last bits, and the losses
are compared to float rounding, even where a later launch is back on the reference's settings. The
seed is printed; TOKSTREAM_INTERRUPTION_SEED=N repeats a schedule.
"""

import os
import random
import re
import signal
import time
from pathlib import Path

import pytest
from conftest import BUCKET, ROOT
from test_training import BASE, launch, metrics, tiny_splits, train, wait_for

from tokstream.errors import UserError
from tokstream.object_store import S3Dataset
from tokstream.testing.processes import kill_tree, worker_pids
from tokstream.train.checkpoint_files import latest_step
from tokstream.train.metrics import METRICS_FILE
from tokstream.train.run_store import S3RunStore

EPOCH_STEPS = 5  # 44 samples at 8 per step: epochs of 40
SOURCES = (("web", 20, "repeat: 1.5"), ("books", 30, "choose: 14"))  # name, train samples, weight
PER_EPOCH = {"web": 27, "books": 13}  # 30 + 14 cut to 40, by largest remainder
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


def mixture(roots: dict[str, str]) -> list[str]:
    """The overrides that train on SOURCES, read from `roots` (name -> dataset root)."""
    streams = ", ".join(f"{{remote: '{roots[name]}', name: {name}, {weight}}}" for name, _, weight in SOURCES)
    return [f"data.streams=[{streams}]"]


def launch_settings(number: int, ranks: int, on_reference: bool, rng: random.Random) -> list[str]:
    """A launch's settings: the reference's (with workers and deterministic=true after the first), or a
    random micro-batch."""
    if on_reference:
        return ["micro_batch_size=4"] + (["data.num_workers=2", "deterministic=true"] if number else [])
    return [f"micro_batch_size={rng.choice(MICRO_BATCHES[ranks])}"]


def on_reference_settings(ranks: int, settings: list[str]) -> bool:
    return ranks == 2 and "micro_batch_size=4" in settings


def on_machine(machine) -> list[str]:
    """The machine's data cache (each source's under it: data.local/<name>) and run_local."""
    return [f"data.local={machine / 'cache'}", f"run_local={machine / 'run'}"]


def blocks_naming(directory: Path) -> dict[str, int]:
    """Streaming's shared-memory blocks registered for cache directories under `directory`: name -> inode."""
    from tokstream.reader.stale_shm import SHM_DIR
    from tokstream.reader.streaming_door.streaming_internals import locals_of_block

    return {p.name: p.stat().st_ino for p in SHM_DIR.glob("*_locals")
            if any(d.startswith(str(directory)) for d in locals_of_block(p.read_bytes()))}


def wait_running(process, condition, timeout: float = 180) -> None:
    """Wait for `condition`; a launch that ends first, or that does not meet it in time, fails the test with its
    output."""
    deadline = time.monotonic() + timeout
    while process.poll() is None and not condition():
        if time.monotonic() > deadline:
            kill_tree(process.pid)
            raise AssertionError(f"the launch did not come to its interruption in {timeout:.0f} s:\n"
                                 + process.communicate(timeout=60)[0][-6000:])
        time.sleep(0.05)
    if process.returncode is not None:
        raise AssertionError(f"the launch ended (status {process.returncode}) before the interruption:\n"
                             + process.stdout.read()[-4000:])


def inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return None


def relaunch_cleared(output: str, stale: dict[str, int], where: str) -> None:
    """The relaunch said it removed the killed run's blocks, and none of them is left under its name."""
    from tokstream.reader.stale_shm import SHM_DIR

    assert "shared-memory blocks a killed run of this dataset left behind" in output, where
    for name, inode in stale.items():  # a block of the same name may be this launch's own
        assert not (SHM_DIR / name).exists() or (SHM_DIR / name).stat().st_ino != inode, where


@pytest.mark.long
def test_a_random_interruption_schedule_resumes_exactly(proxy, tmp_path):
    seed = int(os.environ.get("TOKSTREAM_INTERRUPTION_SEED", random.randrange(1_000_000)))
    print(f"interruption schedule: TOKSTREAM_INTERRUPTION_SEED={seed}")
    rng = random.Random(seed)
    local_roots = {}
    for index, (name, samples, _) in enumerate(SOURCES):
        (tmp_path / name).mkdir()
        local_roots[name] = str(tiny_splits(tmp_path / name, samples, 1000, seed=index + 1))
    train(2, None, tmp_path / "reference", *mixture(local_roots), *COMMON, "eval_interval=8")
    reference = metrics(tmp_path / "reference")
    check_the_mixture(reference)
    remotes = {name: upload(Path(root), f"s3://{BUCKET}/interruptions-{seed}/{name}")
               for name, root in local_roots.items()}
    data = mixture(remotes)
    run_dir = f"s3://{BUCKET}/runs/interrupted-{seed}"
    store = S3RunStore(run_dir, tmp_path / "reader")

    def latest() -> int:
        return latest_step(store) or 0

    resume, ranks, schedule = 0, 2, []
    on_reference = True  # until a launch has resumed on the reference's settings and trained on
    segments = []  # (first step, last step, on the reference's settings) of each launch's kept steps
    saved_on = None  # the ranks of the launch that saved the checkpoint the next launch resumes from
    killed_on = None  # the machine a SIGKILL left its cache and shared memory on
    for number, kind in enumerate(rng.sample(KINDS, len(KINDS))):
        machine = killed_on or tmp_path / f"machine{number}"
        stale = blocks_naming(machine / "cache") if killed_on else {}
        assert stale or not killed_on, "the kill left no shared memory behind: the test no longer reproduces it"
        settings = launch_settings(number, ranks, on_reference, rng)
        at = {"SIGTERM during evaluation": resume + 2, "SIGKILL after an epoch-end checkpoint": next_epoch_end(resume),
              "SIGKILL during a checkpoint upload": next_epoch_end(resume)}.get(kind, resume + rng.randint(1, 2))
        if kind == "SIGTERM during evaluation":
            settings += [f"eval_interval={at}", "eval_batches=100000",  # the whole 2,000-sample split: seconds
                         "preempt_grace_s=0.01"]  # and a grace period no save fits in
        if kind == "SIGKILL during a checkpoint upload":
            proxy.hold("PUT", f"/ckpt-{at:08d}.pt", seconds=120)
        if kind == "SIGKILL after an epoch-end checkpoint":  # steps take milliseconds: a kill that lands late must
            # not leave the next epoch end's file behind (a later "during an upload" checks that none is there)
            proxy.hold("PUT", f"/ckpt-{at + EPOCH_STEPS:08d}.pt", seconds=120)
        left_behind = inode(machine / "run" / METRICS_FILE)  # the killed launch's local metrics, if any
        process = launch(ranks, None, run_dir, *data, *COMMON, *on_machine(machine), *settings)
        if kind == "SIGKILL after an epoch-end checkpoint":
            wait_running(process, lambda: latest() >= at)
            kill_tree(process.pid)
        elif kind == "SIGKILL during a checkpoint upload":
            wait_running(process, proxy.holding.is_set)  # training goes on: the save is in the background
            kill_tree(process.pid)
        else:
            # run_local's metrics.jsonl: the steps resumed, then this launch's, once it has replaced what a
            # killed launch left there
            steps_here = lambda: (len(metrics(machine / "run"))  # noqa: E731
                                  if inode(machine / "run" / METRICS_FILE) != left_behind else 0)
            wait_running(process, lambda: steps_here() >= (at - 1 if kind == "SIGTERM during evaluation" else at))
            if kind == "SIGTERM during evaluation":
                time.sleep(0.3)  # step `at` takes milliseconds, its evaluation seconds
            if kind == "SIGUSR1 to one rank":
                os.kill(worker_pids(process.pid)[-1], signal.SIGUSR1)  # e.g. Slurm --signal; the others follow
            else:
                process.send_signal(signal.SIGTERM)  # torchrun forwards it to every rank
        output, _ = process.communicate(timeout=120)
        proxy.clear()
        stopped = latest()
        where_launched = "the killed run's machine" if stale else "a new machine"
        schedule.append(f"{ranks} rank(s), {' '.join(settings)}, on {where_launched}: {kind} at step {at} -> "
                        f"resumes at {stopped}")
        where = f"seed {seed}, {schedule[-1]}\n" + output[-3000:]
        if stale:
            relaunch_cleared(output, stale, where)
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
        segments.append((resume + 1, stopped, on_reference_settings(ranks, settings)))
        on_reference = on_reference and not 0 < resume < stopped
        saved_on = ranks if stopped != resume else saved_on
        resume, ranks = stopped, (2 if on_reference else 3 - ranks)
        killed_on = machine if kind.startswith("SIGKILL") else None

    refused_recipe(run_dir, data, tmp_path)
    micro = rng.choice(MICRO_BATCHES[ranks])
    machine = killed_on or tmp_path / "last"
    stale = blocks_naming(machine / "cache") if killed_on else {}
    schedule.append(f"{ranks} rank(s), micro_batch_size={micro}, on "
                    f"{'the killed run' + chr(39) + 's machine' if stale else 'a new machine'}: to the end")
    output = train(ranks, None, run_dir, *data, *COMMON, f"micro_batch_size={micro}", *on_machine(machine))
    segments.append((resume + 1, 16, on_reference_settings(ranks, [f"micro_batch_size={micro}"])))
    assert f"resumed from {run_dir}/ckpt-{resume:08d}.pt" in output
    if saved_on not in (None, ranks):  # each accepted change is said at start
        assert (f"relaunch: resuming a {saved_on}-rank run on {ranks} ranks: same samples at every step; losses "
                "match to float rounding, not bitwise") in output, schedule
    if stale:
        relaunch_cleared(output, stale, schedule[-1])

    interrupted = metrics(run_dir)  # the copy uploaded with the final checkpoint
    print("\n".join(schedule))
    bitwise = bitwise_steps(segments)
    assert any(first > 1 for first, _, _ in segments if first in bitwise), "no resumed step compared bitwise"
    assert [m["step"] for m in interrupted] == [m["step"] for m in reference] == list(range(1, 17))
    for got, want in zip(interrupted, reference):
        where = f"seed {seed}, step {got['step']}:\n" + "\n".join(schedule)
        assert sorted(sum(got["samples"], [])) == sorted(sum(want["samples"], [])), where
        assert got["samples_per_source"] == want["samples_per_source"], where
        if len(got["samples"]) == 2:
            assert got["samples"] == want["samples"], where
        assert got["lr"] == want["lr"], where
        if got["step"] in bitwise:
            assert got["loss"] == want["loss"], where
        else:
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-4), where


def bitwise_steps(segments: list[tuple[int, int, bool]]) -> set[int]:
    """The steps whose losses must be bitwise: those of the launches on the reference's settings, up to
    the first launch that kept a step trained on others."""
    steps = set()
    for first, last, on_reference in segments:
        if first > last:  # none of its steps kept: a kill undid them
            continue
        if not on_reference:
            break
        steps.update(range(first, last + 1))
    return steps


def refused_recipe(run_dir: str, data: list[str], tmp_path) -> None:
    """A relaunch that changes the recipe or the mixture is refused before anything is built (what
    train/main.py runs first; that such errors reach the console as one line through torchrun:
    test_training.py)."""
    from tokstream.train.config import load_config
    from tokstream.train.trainer import setup

    store = S3RunStore(run_dir, tmp_path / "reader")

    def files() -> list[str]:  # the run's: a killed job's stale LEASE is taken over, and given back
        return [name for name in store.names() if name != "LEASE"]

    before = files()
    changes = {
        "optim.lr=0.001": "optim.lr changed from 0.003 to 0.001 since the checkpoint: a resumed run keeps its "
                          "recipe; use a new run_dir, or add resume_allow=[optim.lr]",
        "data.streams.1.choose=20": "data.streams.1.choose changed from 14 to 20 since the checkpoint: the mixture, "
                                    "and so the sample order, would change; keep it, or use a new run_dir",
        f"data.streams.2={{remote: {tmp_path / 'web' / 'ds'}, name: more}}":
            "data.streams: the checkpoint's run read a mixture of 2, this launch a mixture of 3: the mixture, and "
            "so the sample order, would change; keep it, or use a new run_dir",
    }
    for change, refusal in changes.items():
        config = load_config(str(ROOT / BASE[0]), [*BASE[1:], *data, *COMMON, "data.remote=", f"run_dir={run_dir}",
                                                   f"data.local={tmp_path / 'refused'}", change])
        with pytest.raises(UserError, match=re.escape(refusal)):
            setup(config)
    assert files() == before and "LEASE" not in store.names()


def check_the_mixture(reference: list[dict]) -> None:
    """The uninterrupted run drew each source's share of every epoch, exactly, and evaluated each source."""
    for start in range(0, len(reference) - EPOCH_STEPS + 1, EPOCH_STEPS):
        epoch = reference[start:start + EPOCH_STEPS]
        drawn = {name: sum(m["samples_per_source"][name] for m in epoch) for name in PER_EPOCH}
        assert drawn == PER_EPOCH, f"epoch {start // EPOCH_STEPS}"
    evaluated = [m for m in reference if "val_loss" in m]
    assert [m["step"] for m in evaluated] == [8, 16]
    for m in evaluated:
        per_source = m["val_loss_per_source"]
        assert sorted(per_source) == ["books", "web"] and per_source["web"] != per_source["books"]
        weighted = (27 * per_source["web"] + 13 * per_source["books"]) / 40
        assert m["val_loss"] == pytest.approx(weighted, rel=1e-12)
