"""Dashboards.write across a relaunch, in-process against TensorBoard's and W&B's own files (the end-to-end runs are
in test_loss_spikes.py): every step shown once, the branch's value where a relaunch trained a step again."""

import json
import multiprocessing
import os
import signal
import time
from pathlib import Path

from test_loss_spikes import OFFLINE

from tokstream.train.config import load_config
from tokstream.train.dashboards import DashboardState, Dashboards, Takeover


def write_then_die_by_sigkill(config, local_dir: str, checkpointed: dict | None, takeover: Takeover,
                              records: list[dict], checkpoint_at: int, saved) -> None:
    """A launch, in a forked process: writes each record, its checkpoint at step `checkpoint_at` saving the
    dashboards' state, and is SIGKILLed right after its last write: no close(), no exit handler."""
    state = DashboardState()
    if checkpointed is not None:
        state.load_state_dict(checkpointed)
    dashboards = Dashboards.open(config, state, takeover, local_dir, master=True)
    for record in records:
        dashboards.write(record)
        if record["step"] == checkpoint_at:
            # Into shared memory, not a file: a file's I/O would let TensorBoard's writer thread write out what write()
            # left unflushed before the kill.
            checkpoint = json.dumps(state.state_dict()).encode()
            saved[:len(checkpoint)] = checkpoint
    os.kill(os.getpid(), signal.SIGKILL)


def killed_launch(config, local_dir: str, checkpointed: dict | None, takeover: Takeover, records: list[dict],
                  checkpoint_at: int) -> dict:
    """Runs a launch that is SIGKILLed right after its last write; the dashboards' state its checkpoint at
    `checkpoint_at` holds."""
    # A fork of the test process's warm server (tests/warm_ranks.py: torch imported, one thread): a launch in well
    # under a second, and no lock another thread of the test process held at the fork.
    context = multiprocessing.get_context("forkserver")
    saved = context.RawArray("c", 4096)  # shared with the launch, zeros
    launch = context.Process(target=write_then_die_by_sigkill, args=(
        config, local_dir, checkpointed, takeover, records, checkpoint_at, saved))
    launch.start()
    launch.join(timeout=60)
    assert launch.exitcode == -signal.SIGKILL
    # TensorBoard reads a folder's event files in name order: the second each was opened in, then the pid. A real
    # relaunch comes seconds after a kill; this one would share its second, and the pids may sort either way.
    time.sleep(1 - time.time() % 1)
    return json.loads(saved.value)


def test_tensorboard_across_killed_launches_relaunches_shows_each_step_once_with_the_branchs_values(tmp_path):
    """A launch logs steps 1-10 and is SIGKILLed; its checkpoint at 6 holds the dashboards' state. The relaunch from 6
    logs 7-12 anew (other values, a skip, the guard's z-score) and is SIGKILLed right after step 12's write (and
    checkpoint); the next relaunch from 12 logs 13-14. TensorBoard shows 1-6 of the first launch, 7-12 of the second
    (its last step too: write() flushes each), 13-14 of the last, a mark at each relaunch's first step, nothing
    twice."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = load_config(None, ["data.remote=d", f"log.tensorboard={tmp_path / 'tb'}"])
    first = [{"step": step, "loss": 10.0 - step, "samples": [[step]]} for step in range(1, 11)]
    branch = [{"step": step, "loss": 100.0 + step} for step in range(7, 15)]
    for record in first + branch:  # several numbers a step: the kill leaves them all unwritten without write()'s flush
        record.update({"lr": record["step"] / 1024, "grad_norm": record["loss"] / 4, "tokens": 1024 * record["step"]})
    branch[2].update({"skipped": {"steps": [9, 11], "samples_left_out": 24}, "guard": {"loss_z": 7.5}})
    # The killed relaunch's last step evaluates many sources: without write()'s flush, TensorBoard's writer thread is
    # still some of its numbers behind when the kill comes.
    validated = {f"source{index}": index + 0.5 for index in range(32)}
    branch[5]["val_loss_per_source"] = validated
    at_6 = killed_launch(config, str(tmp_path), None, Takeover(0, False, None), first, checkpoint_at=6)
    assert at_6["tensorboard_step"] == 6
    at_12 = killed_launch(config, str(tmp_path), at_6, Takeover(6, True, "relaunched from step 6 (kill)"), branch[:6],
                          checkpoint_at=12)
    assert at_12["tensorboard_step"] == 12
    state = DashboardState()
    state.load_state_dict(at_12)
    last = Dashboards.open(config, state, Takeover(12, False, "relaunched from step 12 (restart)"), str(tmp_path),
                           master=True)
    for record in branch[6:]:
        last.write(record)
    last.close()
    assert state.tensorboard_step == 14

    board = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "tensors": 0},
                             purge_orphaned_data=True)
    board.Reload()
    shown = first[:6] + branch
    assert {tag: [(event.step, event.value) for event in board.Scalars(tag)] for tag in board.Tags()["scalars"]} == {
        **{name: [(record["step"], record[name]) for record in shown] for name in ("loss", "lr", "grad_norm",
                                                                                     "tokens")},
        "skipped_steps": [(9, 3.0)], "guard/loss_z": [(9, 7.5)],  # no "samples": not a number on the step axis
        **{f"val_loss/{source}": [(12, loss)] for source, loss in validated.items()}}
    assert [(event.step, event.tensor_proto.string_val[0].decode()) for event in board.Tensors("run/text_summary")] \
        == [(7, "relaunched from step 6 (kill)"), (13, "relaunched from step 12 (restart)")]


def close_as_the_launchs_end_would(dashboards: Dashboards) -> None:
    """Closes a launch's dashboards and ends its W&B session, as the end of the launch's process does: W&B's service
    writes a run's file out after finish() returns, and only that end waits for it."""
    import wandb

    dashboards.close()
    wandb.teardown()


def wandb_files(folder: Path) -> dict[str, list[Path]]:
    """Each W&B run's offline files under folder, by run id, in the order its launches started."""
    from tokstream.testing.wandb_files import run_record

    runs: dict[str, list[Path]] = {}
    for path in (folder / "wandb").glob("offline-run-*/run-*.wandb"):
        runs.setdefault(run_record(path).run_id, []).append(path)
    return {run_id: sorted(paths, key=lambda path: run_record(path).start_time.ToNanoseconds())
            for run_id, paths in runs.items()}


def test_wandb_across_a_killed_launchs_relaunch_holds_each_step_once_with_the_branchs_values(tmp_path, monkeypatch):
    """A launch logs steps 1-10 to W&B and is killed; its checkpoint at 6 holds the dashboards' state. Its run holds
    7-10 of the killed branch and W&B's history only grows, so the relaunch from 6 logs 7-12 (other values, a skip,
    the guard's z-score) to a run of its own, "<name> (branch 1)", forked from the first at step 6, its config saying
    which run and step. Preempted at 12 (nothing logged past it), the next relaunch goes on in the branch's run (its
    id, resumed) with 13-14. No run holds a step twice; the first run's 1-6 and the branch's 7-14 are the branch's
    values; each relaunch says in the run's console where it took over and which run it logs to."""
    from tokstream.testing.wandb_files import history, records, run_record

    for name, value in OFFLINE.items():
        monkeypatch.setenv(name, value)
    config = load_config(None, ["data.remote=d", "log.wandb={project: tokstream-tests, name: gpt2-owt}"])
    state = DashboardState()
    first = Dashboards.open(config, state, Takeover(0, False, None), str(tmp_path), master=True)
    for step in range(1, 11):
        first.write({"step": step, "loss": 10.0 - step, "samples": [[step]]})
        if step == 6:
            at_6 = state.state_dict()
    close_as_the_launchs_end_would(first)  # what W&B holds of a SIGKILLed launch is what it wrote: here all of 1-10
    first_id = at_6["wandb_id"]
    assert at_6 == {"wandb_id": first_id, "branch": 0, "wandb_step": 6, "tensorboard_step": 0}

    state = DashboardState()
    state.load_state_dict(at_6)
    branch = Dashboards.open(config, state, Takeover(6, True, "relaunched from step 6 (kill)"), str(tmp_path),
                             master=True)
    branch_id = state.wandb_id
    # A checkpoint before the branch's first step (a preemption notice at once) already names its run, holding 1-6.
    assert branch_id != first_id
    assert state.state_dict() == {"wandb_id": branch_id, "branch": 1, "wandb_step": 6, "tensorboard_step": 0}
    for step in range(7, 13):
        record = {"step": step, "loss": 100.0 + step}
        if step == 9:
            record.update({"skipped": {"steps": [9, 11], "samples_left_out": 24}, "guard": {"loss_z": 7.5}})
        branch.write(record)
    at_12 = state.state_dict()
    close_as_the_launchs_end_would(branch)
    assert at_12 == {"wandb_id": branch_id, "branch": 1, "wandb_step": 12, "tensorboard_step": 0}

    state = DashboardState()
    state.load_state_dict(at_12)
    last = Dashboards.open(config, state, Takeover(12, False, "relaunched from step 12 (preemption)"), str(tmp_path),
                           master=True)
    for step in (13, 14):
        last.write({"step": step, "loss": 100.0 + step})
    close_as_the_launchs_end_would(last)
    assert state.state_dict() == {"wandb_id": branch_id, "branch": 1, "wandb_step": 14, "tensorboard_step": 0}

    runs = wandb_files(tmp_path)
    assert sorted(runs) == sorted([first_id, branch_id]) and len(runs[first_id]) == 1 and len(runs[branch_id]) == 2
    launches = [runs[first_id][0], *runs[branch_id]]

    def numbers(path: Path) -> list[tuple[int, dict]]:
        return [(logged["_step"], {name: value for name, value in logged.items() if not name.startswith("_")})
                for logged in history(path)]

    assert [numbers(path) for path in launches] == [
        [(step, {"loss": 10.0 - step}) for step in range(1, 11)],
        [(7, {"loss": 107.0}), (8, {"loss": 108.0}),
         (9, {"loss": 109.0, "skipped_steps": 3.0, "guard/loss_z": 7.5}), (10, {"loss": 110.0}),
         (11, {"loss": 111.0}), (12, {"loss": 112.0})],
        [(13, {"loss": 113.0}), (14, {"loss": 114.0})]]
    said = [run_record(path) for path in launches]
    assert [run.display_name for run in said] == ["gpt2-owt", "gpt2-owt (branch 1)", "gpt2-owt (branch 1)"]
    # resume: the run the checkpoint names is continued (W&B's "allow"), never forked; the branch is forked, not resumed
    assert [run.resume for run in said] == [True, False, True]
    assert [(run.branch_point.run, run.branch_point.value, run.branch_point.metric) for run in said] == \
        [("", 0.0, ""), (first_id, 6.0, "_step"), ("", 0.0, "")]
    assert [json.loads({item.key: item.value_json for item in run.config.update}.get("tokstream_branch", "null"))
            for run in said] == [None, {"of": first_id, "at_step": 6, "branch": 1}, None]
    console = [[record.output_raw.line for record in records(path)
                if record.WhichOneof("record_type") == "output_raw" and record.output_raw.line.strip()]
               for path in launches]
    assert console == [[], [f"wandb: relaunched from step 6 (kill); logging to run {branch_id}"],
                       [f"wandb: relaunched from step 12 (preemption); logging to run {branch_id}"]]


def test_dashboards_off_for_a_launch_are_given_nothing_and_hold_only_their_branch_when_on_again(tmp_path, monkeypatch):
    """Both dashboards off for steps 1-2, on for 3-8 (checkpoint at 4), off for a rewind to 4 that trains 5-12 again,
    on from 12 for 13-14. TensorBoard shows 3-4 and 13-14, each once, a mark at each launch's first step it saw; W&B
    holds a first run "<name>" with 3-8 (not a branch: it held nothing of another) and a branch forked from it at 4,
    the last step they share, holding 13-14. A launch with a dashboard off leaves the checkpoint's record of it as
    it was."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tokstream.testing.wandb_files import history, run_record

    for name, value in OFFLINE.items():
        monkeypatch.setenv(name, value)
    off = load_config(None, ["data.remote=d"])
    on = load_config(None, ["data.remote=d", f"log.tensorboard={tmp_path / 'tb'}",
                            "log.wandb={project: tokstream-tests, name: gpt2-owt}"])

    def launch(config, checkpointed: dict | None, takeover: Takeover, steps, loss_base: float,
               checkpoint_at: int) -> dict:
        """Writes each step's record from the checkpoint `checkpointed` on; the state its checkpoint at checkpoint_at
        holds."""
        state = DashboardState()
        if checkpointed is not None:
            state.load_state_dict(checkpointed)
        dashboards = Dashboards.open(config, state, takeover, str(tmp_path), master=True)
        for step in steps:
            dashboards.write({"step": step, "loss": loss_base + step})
            if step == checkpoint_at:
                saved = state.state_dict()
        close_as_the_launchs_end_would(dashboards)
        return saved

    at_2 = launch(off, None, Takeover(0, False, None), range(1, 3), 0.0, checkpoint_at=2)
    assert at_2 == {"wandb_id": None, "branch": 0, "wandb_step": 0, "tensorboard_step": 0}
    at_4 = launch(on, at_2, Takeover(2, False, "relaunched from step 2 (preemption)"), range(3, 9), 20.0,
                  checkpoint_at=4)
    first_id = at_4["wandb_id"]
    assert at_4 == {"wandb_id": first_id, "branch": 0, "wandb_step": 4, "tensorboard_step": 4}
    at_12 = launch(off, at_4, Takeover(4, True, "rewound to step 4 (rewind)"), range(5, 13), 30.0, checkpoint_at=12)
    assert at_12 == at_4
    at_14 = launch(on, at_12, Takeover(12, False, "relaunched from step 12 (end)"), (13, 14), 40.0, checkpoint_at=14)
    branch_id = at_14["wandb_id"]
    assert branch_id != first_id
    assert at_14 == {"wandb_id": branch_id, "branch": 1, "wandb_step": 14, "tensorboard_step": 14}

    board = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "tensors": 0},
                             purge_orphaned_data=True)
    board.Reload()
    assert [(event.step, event.value) for event in board.Scalars("loss")] == \
        [(3, 23.0), (4, 24.0), (13, 53.0), (14, 54.0)]
    assert [(event.step, event.tensor_proto.string_val[0].decode()) for event in board.Tensors("run/text_summary")] \
        == [(3, "relaunched from step 2 (preemption)"), (13, "relaunched from step 12 (end)")]

    runs = wandb_files(tmp_path)
    assert sorted(runs) == sorted([first_id, branch_id])
    (first,), (branch,) = runs[first_id], runs[branch_id]
    assert [(logged["_step"], logged["loss"]) for logged in history(first)] == [(step, 20.0 + step)
                                                                               for step in range(3, 9)]
    assert [(logged["_step"], logged["loss"]) for logged in history(branch)] == [(13, 53.0), (14, 54.0)]
    said = [run_record(first), run_record(branch)]
    assert [run.display_name for run in said] == ["gpt2-owt", "gpt2-owt (branch 1)"]
    assert [(run.branch_point.run, run.branch_point.value) for run in said] == [("", 0.0), (first_id, 4.0)]
    assert [json.loads({item.key: item.value_json for item in run.config.update}.get("tokstream_branch", "null"))
            for run in said] == [None, {"of": first_id, "at_step": 4, "branch": 1}]
