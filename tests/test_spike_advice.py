"""What the loss-spike guard tells a person at 3 a.m., and what a rewind keeps, checked where it is decided (fast,
in-process): every advice is accepted when pasted, a rewind to the newest checkpoint keeps the lines it cuts, and a
setting that would silently do nothing is refused. The end-to-end runs are in test_loss_spikes.py."""

import json
import math
import re
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

from tokstream.errors import UserError
from tokstream.train.checkpoint_files import Survey, checkpoint_name, manifest_name, pointer_step, write_checkpoint
from tokstream.train.config import load_config
from tokstream.train.metrics import METRICS_FILE, parse_records
from tokstream.train.preemption import PREEMPTED_EXIT_STATUS
from tokstream.train.resume_policy import check_relaunch
from tokstream.train.rewind import ABANDONED, abandoned_records, rewind, rewind_target
from tokstream.train.run_store import LocalRunStore, S3RunStore
from tokstream.train.spike_guard import MIN_HISTORY, SpikeGuard, advice, skips_with_spike

BASE = ["data.remote=d", "max_steps=300"]


def pasted(line: str) -> list[str]:
    """The settings an advice line tells the user to relaunch with."""
    assert line.startswith("relaunch with: "), line
    return line[len("relaunch with: "):].split(" (")[0].split()


@pytest.mark.parametrize("skips,spike", [
    ([], 50), ([[36, 37]], 32), ([[36, 37]], 36), ([[36, 37]], 37), ([[36, 37]], 34), ([[10, 12], [36, 37]], 37),
    ([[36, 90]], 60), ([[36, 90]], 80), ([[36, 37]], 299), ([[36, 37], [200, 210]], 100), ([[20, 30]], 25),
    ([[250, 260]], 255), ([[280, 290]], 295), ([[100, 110]], 111)])
def test_every_advice_is_accepted_when_pasted_and_leaves_the_spikes_data_out(skips, spike):
    """The advice after a spike at `spike` with skip_steps `skips` already set: pasted as printed, the relaunch is
    accepted (the config's own checks, and the relaunch policy against the checkpoint it names, which has not begun
    any skip that changes), and the spike step reads data guard.skip steps or more past what it read."""
    saved = list(range(10, spike, 10))
    original = load_config(None, [*BASE, f"skip_steps={json.dumps(skips)}"])
    settings = pasted(advice(saved, spike, skips, rewind=20, skip=5, max_steps=300))
    relaunch = load_config(None, [*BASE, *settings])  # refused in one line if the advice were not a valid setting
    target = int(settings[0].removeprefix("resume_from="))
    assert target in saved and target < spike
    check_relaunch(original.to_dict(), relaunch, target)  # raises if it changed a skip the checkpoint has begun

    def jump(skip_steps, step):  # steps of data a step reads past its number (a skip jumps at its first step)
        return sum(last - first + 1 for first, last in skip_steps if first <= step)
    spikes_data = spike + jump(skips, spike)
    read = {step + jump(relaunch.skip_steps, step) for step in range(target + 1, 301)}
    assert spikes_data not in read  # no step of the relaunch trains on it, before the spike's step or after
    if max(last for _, last in relaunch.skip_steps) < 300:  # not cut short by max_steps: the whole window left out
        assert not read & set(range(spikes_data, spikes_data + 5))
    assert all(last <= 300 for _, last in relaunch.skip_steps)


def test_the_spikes_skip_is_merged_sorted_joined_and_ends_at_max_steps():
    assert skips_with_spike([[36, 37]], 32, 3, 100) == [[32, 34], [36, 37]]
    assert skips_with_spike([[36, 37]], 36, 3, 100) == [[36, 40]]  # at a skip's first step: it grows
    assert skips_with_spike([[36, 37]], 37, 3, 100) == [[36, 41]]  # inside it: by the steps it is in, too
    assert skips_with_spike([[10, 20]], 15, 3, 100) == [[10, 28]]  # step 15 read step 26's data: from 10, read 29 on
    assert skips_with_spike([[90, 95]], 93, 5, 100) == [[90, 100]]  # the spike's data left out, the window cut
    assert skips_with_spike([[90, 100]], 95, 3, 100) is None  # a skip to step 100 still reads step 106's data
    assert advice([80], 95, [[90, 100]], rewind=5, skip=3, max_steps=100) == (
        "no skip can: step 95 is inside skip_steps [90, 100], which reads the data of step 106, and leaving that out "
        "needs the skip to end past max_steps=100: raise max_steps, or relaunch from an earlier checkpoint with other "
        "settings (a lower learning rate)")
    assert skips_with_spike([[36, 37]], 34, 3, 100) == [[34, 37]]  # overlapping the next: joined
    assert skips_with_spike([], 31, 200, 40) == [[31, 40]]  # never past max_steps (it would be refused)


def test_the_advice_says_when_no_checkpoint_is_guard_rewind_steps_back_and_when_none_comes_before():
    said = advice([10, 20, 30], 37, [[36, 37]], rewind=100, skip=3, max_steps=100)
    assert said == ("relaunch with: resume_from=30 skip_steps=[[36,41]] (no kept checkpoint is guard.rewind=100 steps "
                    "before it: step 30 is the newest before step 36)")
    assert advice([], 37, [], rewind=100, skip=3, max_steps=100) == (
        "no kept checkpoint comes before step 37: train again in a new run_dir with skip_steps=[[37,39]]")


def test_a_relaunch_from_a_skips_first_step_keeps_that_skip_as_it_was():
    """A checkpoint at step 12 of a run with skip_steps [[12,14]] trained step 12 after the skip's jump: from there
    the skip can be neither removed, nor narrowed, nor widened; from step 11 it still may change."""
    saved = load_config(None, [*BASE, "skip_steps=[[12,14]]"]).to_dict()
    for now in ("[]", "[[12,16]]", "[[12,13]]"):
        relaunch = load_config(None, [*BASE, f"skip_steps={now}"])
        with pytest.raises(UserError, match="begins at or before step 12, which the checkpoint's run has trained"):
            check_relaunch(saved, relaunch, 12)
        assert check_relaunch(saved, relaunch, 11) == [f"skip_steps changed from [[12, 14]] to {json.loads(now)!r}, "
                                                       "after the checkpoint's step 11"]


def refusal(*settings: str) -> str:
    with pytest.raises(UserError) as refused:
        load_config(None, ["data.remote=d", *settings])
    return str(refused.value)


def test_settings_that_would_silently_do_nothing_are_refused_in_one_line():
    assert refusal("guard.window=8") == ("guard.window must be a whole number at least 16, got 8 (a step is judged "
                                         f"once the window holds {MIN_HISTORY} steps)")
    assert refusal("max_steps=24", "skip_steps=[[22,1000000000]]") == (
        "skip_steps: [22, 1000000000] ends past max_steps=24: a skip leaves out steps the run trains, so it ends at "
        "max_steps at the latest (a typo?)")
    assert "YAML reads A:B as a number in base 60" in refusal("skip_steps=12:14")
    assert refusal("resume_from=4.5") == "command line: resume_from must be a whole number, got 4.5"
    load_config(None, ["data.remote=d", "guard.window=16", "max_steps=24", "skip_steps=[[22,24]]"])
    # guard.rewinds_done is the guard's record: hand-made entries would be counted, or fail a later relaunch.
    for done in ("[1,2]", "[{spike: 3}]", "[{},{},{}]", "[{spike: 9, resume_from: 9, skip_steps: [[9,12]]}]",
                 "[{spike: 9, resume_from: 4, skip_steps: [[12,9]]}]", "7"):
        assert refusal(f"guard.rewinds_done={done}").endswith(
            "it is recorded by the guard's own rewinds ({spike, resume_from, skip_steps} each), not set by hand; "
            "leave it out"), done
    load_config(None, ["data.remote=d", "guard.rewinds_done=[{spike: 9, resume_from: 4, skip_steps: [[9,12]]}]"])


def test_the_guard_judges_again_only_once_its_window_refills_after_a_reset():
    guard = SpikeGuard(zscore=3, window=32)
    for step in range(40):
        assert guard.judge(1.0 + 0.01 * (step % 3), 1.0) is None
    assert guard.judge(50.0, 1.0) is not None  # judged: a spike
    guard.reset()  # a phase that changes the data, or a rewind
    for _ in range(MIN_HISTORY):
        assert guard.judge(50.0, 1.0) is None  # not judged against the old statistics: joins the new window
    assert guard.judge(500.0, 1.0) is not None


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nan_or_inf_loss_or_gradient_norm_is_a_spike_and_never_enters_the_window(bad):
    for history in (0, 40):  # before the window can judge, and after
        guard = SpikeGuard(zscore=6, window=32)
        for step in range(history):
            assert guard.judge(3.0 + 0.01 * (step % 5), 1.0 + 0.01 * (step % 3)) is None
        assert guard.judge(bad, 1.0) is not None and guard.judge(3.0, bad) is not None
        assert all(math.isfinite(value) for value in [*guard.losses, *guard.norms]) and len(guard.losses) == min(history, 32)


def test_the_guards_window_across_a_resume_judges_as_the_uninterrupted_guard():
    """Its state (the window) saved mid-run and loaded into a fresh guard: every later judgement is the same, the
    spike included; a guard that started empty would not judge it (its window too short)."""
    steps = [(3.0 + 0.05 * math.sin(step), 1.0 + 0.02 * math.cos(step)) for step in range(60)]
    steps[50] = (9.0, 5.0)
    straight, first = SpikeGuard(zscore=6, window=32), SpikeGuard(zscore=6, window=32)
    verdicts = [straight.judge(*step) for step in steps]
    for step in steps[:40]:
        first.judge(*step)
    resumed = SpikeGuard(zscore=6, window=32)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # as a checkpoint holds it
    assert [resumed.judge(*step) for step in steps[40:]] == verdicts[40:] and verdicts[50] is not None
    fresh = SpikeGuard(zscore=6, window=32)
    assert [fresh.judge(*step) for step in steps[40:]][10] is None


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_rewind_moves_every_save_after_its_target_cut_off_or_not_so_the_branch_never_overwrites_one(where, tmp_path,
                                                                                                   request):
    """After the target at 8: a checkpoint at the very next step, one at 12, a save at 16 cut off before its manifest
    and a manifest at 20 whose data file is gone. The rewind to 8 sets every one of them aside byte for byte, and
    leaves nothing of theirs where the branch saves those steps again."""
    store = run_store(where, tmp_path, request, "rewind-cut-off")
    saved_run(store, [4, 8, 9, 12], lines_to(20))
    store.publish_bytes(checkpoint_name(16), b"a save cut off before its manifest")
    store.publish_bytes(manifest_name(20), store.read_bytes(manifest_name(12)))  # its data file is gone
    later = [checkpoint_name(9), manifest_name(9), checkpoint_name(12), manifest_name(12), checkpoint_name(16),
             manifest_name(20)]
    before = {name: store.read_bytes(name) for name in later}
    kept = {name: store.read_bytes(name) for name in store.names() if name.startswith("ckpt-") and name not in later}
    said = rewind(store, 8, [[9, 11]])
    assert said.startswith("resume_from=8: rewound; checkpoints 9, 12, 16, 20 and metrics.jsonl as it was moved to"), \
        said
    folder = re.search(rf"({ABANDONED}/after-00000008-[^/ ]+)", said).group(1)
    assert {name: store.read_bytes(f"{folder}/{name}") for name in later} == before
    assert not set(later) & set(store.names()) and pointer_step(store) == (8, None)  # LATEST names the target
    assert len(kept) == 4 and {name: store.read_bytes(name) for name in kept} == kept  # 4 and 8, as they were


def run_store(where: str, tmp_path, request, prefix: str):
    """A run_dir's store: a local folder, or an S3 prefix on the tests' loopback S3."""
    if where == "local":
        return LocalRunStore(str(tmp_path / "run"))
    request.getfixturevalue("proxy")
    from conftest import BUCKET
    return S3RunStore(f"s3://{BUCKET}/{prefix}", tmp_path / "local")


def saved_run(store, steps: list[int], lines: list[dict], config: dict | None = None) -> None:
    """Checkpoints at `steps` (their run's config `config`) and metrics.jsonl holding `lines`."""
    for step in steps:
        state = {"progress": {"step": step}, "weights": torch.zeros(4), "run": {"config": config or {}}}
        write_checkpoint(store, step, state, 0, "run", trusted=Survey.of(store).complete)
    store.publish_bytes(METRICS_FILE, "".join(json.dumps(line) + "\n" for line in lines).encode())


def lines_to(step: int, **extra) -> list[dict]:
    return [{"step": s, "loss": 1.0 / s, **extra} for s in range(1, step + 1)]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_rewind_to_the_newest_checkpoint_keeps_the_lines_it_cuts_and_not_its_own_branchs(where, tmp_path, request):
    """A spike stop after the newest checkpoint (the usual case with guard.rewind=100 and 2 checkpoints kept): the
    advice names that checkpoint, no checkpoint moves, and the lines past it (the spike's own among them) are copied
    under abandoned/ for train/plot.py. A relaunch of that branch (the same resume_from and skips) copies nothing."""
    if where == "s3":
        request.getfixturevalue("proxy")
        from conftest import BUCKET
        run_dir = f"s3://{BUCKET}/rewind-newest"
        store = S3RunStore(run_dir, tmp_path / "local")
    else:
        run_dir = str(tmp_path / "run")
        store = LocalRunStore(run_dir)
    spike = {"step": 14, "loss": 9.0, "grad_norm": 3.0, "guard": {"loss_z": 8.1, "grad_norm_z": 2.0, "update": "stopped"}}
    saved_run(store, [8, 12], [*lines_to(13), spike])
    said = rewind(store, 12, [[14, 16]])
    assert said.startswith("resume_from=12: rewound; no checkpoint came after it; metrics.jsonl as it was (the steps "
                           "after it) copied to "), said
    assert Survey.of(store).complete == [8, 12]
    assert abandoned_records(run_dir, 12) == [lines_to(13)[-1], spike]
    # Stopped after the rewind, before its relaunch cut the lines: the next launch finds them set aside already.
    assert rewind(store, 12, [[14, 16]]) is None
    if where == "local":
        assert len(list((tmp_path / "run" / ABANDONED).iterdir())) == 1
    # The branch's first launch logs step 13 with its relaunch; killed before a checkpoint, relaunched: nothing moves.
    branch_start = {"step": 13, "loss": 0.5, "relaunch": {"from_step": 12, "after": "rewind", "skip_steps": [[14, 16]]}}
    saved_run(store, [], [*lines_to(12), branch_start])
    assert rewind(store, 12, [[14, 16]]) is None
    assert abandoned_records(run_dir, 12) == [lines_to(13)[-1], spike]
    # Another branch from the same checkpoint (other skips): the first branch's lines are kept too.
    assert rewind(store, 12, [[14, 20]]) is not None
    assert abandoned_records(run_dir, 12) == [branch_start]
    if where == "local":
        assert len(list((tmp_path / "run" / ABANDONED).iterdir())) == 2
    assert parse_records(store.read_bytes(METRICS_FILE), METRICS_FILE)[-1] == branch_start  # the relaunch cuts it


def test_new_advice_with_the_same_resume_from_rewinds_a_branch_that_its_own_relaunch_goes_on_in(tmp_path):
    """A branch from 8 (skip_steps [[9,11]]) saved 12 and 16; a spike there advises resume_from=8 again with one more
    skip: that rewinds, the branch's checkpoints and lines set aside. A relaunch of the branch's own command, or one
    whose skips the branch holds (the guard's rewinds join them into larger ones), goes on in it."""
    store = LocalRunStore(tmp_path / "run")
    saved_run(store, [4, 8], lines_to(8))
    branch_start = {"step": 9, "loss": 0.5, "relaunch": {"from_step": 8, "after": "rewind", "skip_steps": [[9, 11]]}}
    saved_run(store, [12, 16], [*lines_to(8), branch_start, *lines_to(17)[9:]],
              config={"resume_from": 8, "skip_steps": [[9, 11], [14, 15]]})
    for own in ([[9, 11]], [[9, 11], [14, 15]]):
        assert rewind(store, 8, own) is None and rewind_target(store, 8, own) is None
    advised = [[9, 11], [14, 15], [17, 19]]
    assert rewind_target(store, 8, advised) == {"run": {"config": {}}, "progress": {"step": 8}}
    said = rewind(store, 8, advised)
    assert said.startswith("resume_from=8: rewound; checkpoints 12, 16 and metrics.jsonl as it was moved to"), said
    assert Survey.of(store).complete == [4, 8] and abandoned_records(str(tmp_path / "run"), 8)[0] == branch_start


@pytest.mark.parametrize("block_raises", [False, True])
def test_a_notice_during_a_rewind_lets_its_moves_finish_and_then_ends_the_launch(tmp_path, block_raises):
    """SIGTERM while starting ends a launch at once, except inside PreemptionWatch.whole() (the rewind's moves, nested
    here): the block finishes, then the launch ends with the preempted status and its one line. An error in the block
    is raised as without a notice (not passed off as a preemption that a scheduler would requeue)."""
    script = f"""
import os, signal
from pathlib import Path
from tokstream.train.preemption import PreemptionWatch
watch = PreemptionWatch()
with watch.whole():
    with watch.whole():
        os.kill(os.getpid(), signal.SIGTERM)
    Path({str(tmp_path / "moved")!r}).write_text("whole")
    if {block_raises}:
        raise PermissionError("the run directory is read-only")
Path({str(tmp_path / "after")!r}).write_text("not reached")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert (tmp_path / "moved").read_text() == "whole" and not (tmp_path / "after").exists()
    if block_raises:
        assert done.returncode == 1 and "PermissionError: the run directory is read-only" in done.stderr, done.stderr
        assert "preempted" not in done.stdout
    else:
        assert done.returncode == PREEMPTED_EXIT_STATUS, done.stderr
        assert done.stdout.startswith("preempted (signal 15) while starting: nothing trained in this launch"), \
            done.stdout
