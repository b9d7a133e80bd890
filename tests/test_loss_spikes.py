"""When the loss spikes (docs/loss-spikes.md): skip_steps leaves out named steps' data, exactly, through a preemption
(SIGTERM to every rank) and a change of world size, and the ledger says what every step read."""

import json
import signal
import sys

import pytest
from conftest import ROOT
from test_training import finish, launch, metrics, train, wait_for
from test_training import launch as launch_to
from warm_ranks import run_warm

from tokstream.testing.processes import identified, notice_when
from tokstream.train.checkpoint_files import latest_step
from tokstream.train.run_store import LocalRunStore

SKIP = "skip_steps=[[6,8]]"


def samples(record: dict) -> list[int]:
    return sorted(sum(record["samples"], []))


def test_skipped_steps_data_is_left_out_exactly_through_a_preemption_and_another_world_size(dataset, reference,
                                                                                          tmp_path):
    """skip_steps [[6, 8]]: step 6 reads what step 9 would have, and every later step what it would three steps on
    (an uninterrupted run without the skip says what each step would have read). With the skip from the start, 2
    ranks SIGTERMed after a checkpoint, relaunched on 1 rank: every step's samples are the uninterrupted skipping run's,
    its losses bitwise until the world size changes; step 6's line says what was left out; the ledger agrees with
    the trace; and a skip that would change a trained step is refused in one line."""
    plain = {step: {"samples": ids} for step, ids, _, _ in reference}  # the shared uninterrupted run, without a skip
    train(2, dataset, tmp_path / "reference", SKIP)
    reference = metrics(tmp_path / "reference")
    for record in reference:
        step = record["step"]
        shifted = step if step < 6 else step + 3
        if shifted in plain:
            assert samples(record) == samples(plain[shifted]), step
    assert reference[5]["skipped"] == {"steps": [6, 8], "samples_left_out": 3 * 8}  # unread: the stream moved on

    run_dir, store = tmp_path / "interrupted", LocalRunStore(str(tmp_path / "interrupted"))
    # the whole val split evaluated at step 10: seconds for the notice to land in before the run ends
    first = launch(2, dataset, run_dir, SKIP, "eval_interval=10", "eval_batches=100000", warm=True)
    wait_for(lambda: (latest_step(store) or 0) >= 8 and len(metrics(run_dir)) >= 9)
    first.send_signal(signal.SIGTERM)
    first.communicate(timeout=120)
    assert first.returncode == 75  # preempted, not ended
    stopped = latest_step(store)
    refused = launch(1, dataset, run_dir, "skip_steps=[[3,4],[6,8]]", warm=True)
    output = refused.communicate(timeout=120)[0]
    assert refused.returncode != 0 and "skip_steps [3, 4] begins at or before step" in output, output
    finish(launch(1, dataset, run_dir, SKIP, warm=True))
    interrupted = metrics(run_dir)
    assert [m["step"] for m in interrupted] == [m["step"] for m in reference]
    for got, want in zip(interrupted, reference):
        assert samples(got) == samples(want), got["step"]
        if got["step"] <= stopped:
            assert got["samples"] == want["samples"] and got["loss"] == want["loss"], got["step"]
    assert [sorted(sum(line["samples"], [])) for line in ledger_lines(run_dir, "1:16")] == \
        [samples(m) for m in interrupted]


def ledger_lines(run_dir, steps: str) -> list[dict]:
    ledger = run_warm("train/ledger.py", run_dir, "--steps", steps, "--json", cwd=ROOT)
    assert ledger.returncode == 0, ledger.stderr
    return [json.loads(line) for line in ledger.stdout.splitlines()]


def digests(folder) -> dict[str, str]:
    import hashlib

    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(folder.iterdir())
            if path.is_file() and (path.name.startswith("ckpt-") or path.name == "metrics.jsonl")}


def test_a_rewind_with_a_skip_trains_as_a_run_that_always_skipped_and_keeps_the_abandoned_branch(dataset, tmp_path):
    """Trained to step 16 (a checkpoint every 4, all kept), relaunched with resume_from=8 skip_steps=[[9,11]]: the
    checkpoints after 8 and metrics.jsonl as it was are moved to abandoned/, byte for byte. The branch, SIGTERMed after
    a checkpoint and relaunched with the same command on 1 rank, goes on from its own newest checkpoint (it does not
    rewind again), and every step is what a run with skip_steps=[[9,11]] from the start trains: the same samples, the
    losses bitwise until the world size changes. The run logs to TensorBoard and to an offline W&B run throughout
    (check_dashboards)."""
    keep_all = "keep_checkpoints=0"
    train(2, dataset, tmp_path / "reference", "skip_steps=[[9,11]]", keep_all)
    reference = metrics(tmp_path / "reference")
    run_dir, store = tmp_path / "run", LocalRunStore(str(tmp_path / "run"))
    keep_all = (keep_all, f"log.tensorboard={run_dir / 'tb'}", "log.wandb={project: tokstream-tests}")

    def launch(*args):
        return launch_to(*args, env=OFFLINE, warm=True)

    finish(launch(2, dataset, run_dir, *keep_all))
    before = {name: digest for name, digest in digests(run_dir).items()
              if name == "metrics.jsonl" or int(name[5:13]) > 8}
    refused = launch(2, dataset, run_dir, "resume_from=8", "skip_steps=[[6,9]]", *keep_all)
    output = refused.communicate(timeout=120)[0]
    assert refused.returncode != 0 and "skip_steps [6, 9] begins at or before step 8" in output, output
    assert not (run_dir / "abandoned").exists() and latest_step(store) == 16  # a refused relaunch moved nothing
    branch = ["resume_from=8", "skip_steps=[[9,11]]", *keep_all]
    first = launch(2, dataset, run_dir, *branch)

    def the_branch_saved_12() -> bool:  # not the old run's 12 or 16 before the rewind moves them: step 9 relaunched
        lines = metrics(run_dir)
        return len(lines) >= 13 and "relaunch" in lines[8] and (latest_step(store) or 0) >= 12

    # Held from their start until then: steps take milliseconds, and a SIGTERM sent as they go lands after step 16.
    notice_when(lambda: identified(rank.pid for rank in first.processes), the_branch_saved_12,
                lambda: first.send_signal(signal.SIGTERM), signal.SIGTERM)
    said = first.communicate(timeout=120)[0]
    assert "resume_from=8: rewound; checkpoints 12, 16 and metrics.jsonl as it was moved to" in said, said
    stopped = latest_step(store)
    again = finish(launch(1, dataset, run_dir, *branch))
    assert "rewound" not in again and f"resumed from {run_dir}/ckpt-{stopped:08d}.pt" in again, again
    (abandoned,) = (run_dir / "abandoned").iterdir()
    assert digests(abandoned) == before  # the abandoned branch, byte for byte
    branch_metrics = metrics(run_dir)
    assert [m["step"] for m in branch_metrics] == [m["step"] for m in reference] == list(range(1, 17))
    for got, want in zip(branch_metrics, reference):
        assert samples(got) == samples(want), got["step"]
        if got["step"] <= stopped:
            assert got["samples"] == want["samples"] and got["loss"] == want["loss"], got["step"]
    assert branch_metrics[8]["skipped"]["steps"] == [9, 11]
    assert [sorted(sum(line["samples"], [])) for line in ledger_lines(run_dir, "1:16")] == \
        [samples(m) for m in branch_metrics]
    check_dashboards(run_dir, branch_metrics, stopped)
    # Each launch's first line says where it took over and why; the plot marks them, and the skip, on the curve.
    assert branch_metrics[8]["relaunch"] == {"from_step": 8, "after": "rewind", "skip_steps": [[9, 11]]}
    assert branch_metrics[stopped]["relaunch"] == {"from_step": stopped, "after": "preemption"}
    assert sum("relaunch" in m for m in branch_metrics) == 2
    from train.plot import plot_runs

    _, marks = plot_runs([str(run_dir)], str(tmp_path / "loss.png"))
    assert marks == [("rewind", 8), ("abandoned", 9), ("skip", 9), ("preemption", stopped)]


OFFLINE = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}


def check_dashboards(run_dir, branch_metrics: list[dict], stopped: int) -> None:
    """Read back what the run of the rewind test logged, from the files alone:
    - TensorBoard, as TensorBoard reads the folder (the relaunches' purge_step applied): steps 1-16 once each, the
      branch's losses (float32), and one text event marking each launch's first step (the rewind, the relaunch);
    - W&B: the first launch's run holds steps 1-16; the rewind started a branch, a run of its own forked from it at
      step 8 (its config says so too), holding steps 9-16 from two launches (the SIGTERM relaunch continued it: the
      checkpoint kept its id); no run logged a step twice; steps 1-8 of the first and 9-16 of the branch are the
      branch's losses, exactly."""
    import numpy as np
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tokstream.testing.wandb_files import history, run_record

    board = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0, "tensors": 0},
                             purge_orphaned_data=True)
    board.Reload()
    assert [(event.step, event.value) for event in board.Scalars("loss")] == \
        [(m["step"], float(np.float32(m["loss"]))) for m in branch_metrics]
    marks = [(event.step, event.tensor_proto.string_val[0].decode()) for event in board.Tensors("run/text_summary")]
    assert marks == [(9, "rewound to step 8 (rewind)"), (stopped + 1, f"relaunched from step {stopped} (preemption)")]

    runs: dict[str, list] = {}
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        runs.setdefault(run_record(path).run_id, []).append(path)
    assert len(runs) == 2 and [len(paths) for paths in runs.values()] in ([1, 2], [2, 1])
    (first, paths_first), (branch, paths_branch) = sorted(runs.items(), key=lambda item: len(item[1]))
    steps = {name: [h["_step"] for path in paths for h in history(path)] for name, paths in runs.items()}
    assert steps[first] == list(range(1, 17)) and steps[branch] == list(range(9, 17))
    forked = run_record(paths_branch[0])
    assert (forked.branch_point.run, forked.branch_point.value) == (first, 8)
    said = {item.key: item.value_json for item in forked.config.update}
    assert json.loads(said["tokstream_branch"]) == {"of": first, "at_step": 8, "branch": 1}
    logged = [h for h in history(paths_first[0]) if h["_step"] <= 8] + [h for path in paths_branch
                                                                        for h in history(path)]
    assert [(h["_step"], h["loss"]) for h in logged] == [(m["step"], m["loss"]) for m in branch_metrics]


def test_the_guard_skips_spikes_updates_and_resumes_exactly(dataset, tmp_path):
    """guard.zscore 0.3 over 16 steps (low, so that spikes come): each spike's line says its update was skipped; a run
    SIGTERMed after step 20 and relaunched judges every step as the uninterrupted run did (its window is in the
    checkpoint): the same losses, bitwise."""
    guard = ["max_steps=30", "optim.decay_steps=30", "guard.zscore=0.3", "guard.window=16", "keep_checkpoints=0"]
    train(1, dataset, tmp_path / "reference", *guard)
    reference = metrics(tmp_path / "reference")
    spikes = [m["step"] for m in reference if "guard" in m]
    assert spikes and all(m["guard"]["update"] == "skipped" for m in reference if "guard" in m), spikes
    assert min(spikes) > 16  # judged once the window holds 16 steps

    run_dir, store = tmp_path / "interrupted", LocalRunStore(str(tmp_path / "interrupted"))
    first = launch(1, dataset, run_dir, *guard, warm=True)
    wait_for(lambda: (latest_step(store) or 0) >= 20 and len(metrics(run_dir)) >= 21)
    first.send_signal(signal.SIGTERM)
    first.communicate(timeout=120)
    finish(launch(1, dataset, run_dir, *guard, warm=True))
    assert [(m["step"], m["loss"], m.get("guard")) for m in metrics(run_dir)] == \
        [(m["step"], m["loss"], m.get("guard")) for m in reference]

    # guard.action stop and rewind, and the advice pasted: test_the_guard_rewinds_by_itself_as_the_pasted_advice_would.


def test_the_guard_rewinds_by_itself_as_the_pasted_advice_would_also_through_a_sigterm_during_the_rewind(
        dataset, tmp_path):
    """guard.action rewind on 2 ranks: at the spike, back to the checkpoint the advice names, the spike's data left
    out, in the same job; the run afterwards equals, step by step (samples, losses bitwise), a run stopped at the spike
    (action stop) and relaunched with its advice pasted, and ends as it does (a second spike: the cap of one rewind
    reached, the same advice and exit 65: not 75, which a scheduler would requeue into the same spike). The abandoned
    branch keeps the spike's line; the job's own command relaunched (a requeue) goes on in the guard's branch. SIGTERMed while it rewinds,
    the job exits 75 and its relaunch with the same command goes on to the same steps."""
    import re

    guard = ["max_steps=30", "optim.decay_steps=30", "guard.zscore=0.3", "guard.window=16", "keep_checkpoints=0",
             "guard.rewind=2", "guard.skip=3", "guard.max_rewinds=1"]

    def steps(run_dir) -> list[tuple]:
        return [(m["step"], m["samples"], m["loss"]) for m in metrics(run_dir)]

    manual = tmp_path / "manual"
    stopped = launch(2, dataset, manual, *guard, "guard.action=stop", warm=True)
    output = stopped.communicate(timeout=300)[0]
    assert stopped.returncode == 65, output  # the ranks' EX_DATAERR
    spike = int(re.search(r"loss spike at step (\d+) \(", output).group(1))
    target = max(step for step in range(4, spike - 2, 4))  # checkpoints every 4 steps; at least 2 before the spike
    advice = re.search(r"update not applied; to rewind and leave out its data, relaunch with: (resume_from=\d+ "
                       r"skip_steps=\S+)\n", output)
    assert advice and advice.group(1) == f"resume_from={target} skip_steps=[[{spike},{spike + 2}]]", output
    assert [m["guard"]["update"] for m in metrics(manual) if m["step"] == spike] == ["stopped"]  # its line is kept
    again = launch(2, dataset, manual, *guard, "guard.action=stop", *advice.group(1).split(), warm=True)
    manual_output = again.communicate(timeout=300)[0]

    auto = tmp_path / "auto"
    rewinding = launch(2, dataset, auto, *guard, "guard.action=rewind", warm=True)
    auto_output = rewinding.communicate(timeout=300)[0]
    assert "guard.action rewind, 1 of guard.max_rewinds=1" in auto_output, auto_output
    assert rewinding.returncode == again.returncode, (auto_output[-3000:], manual_output[-3000:])
    final = lambda text: re.findall(r"relaunch with: .*", text)  # noqa: E731  the second spike's advice, if any
    assert final(auto_output) == final(manual_output)
    assert steps(auto) == steps(manual)
    (branch,) = (auto / "abandoned").iterdir()
    # A requeue relaunches the job's own command: it goes on in the branch the guard chose (its skips kept), not refused.
    requeued = launch(2, dataset, auto, *guard, "guard.action=rewind", "max_steps=32", warm=True)
    said = requeued.communicate(timeout=300)[0]
    assert "begins at or before step" not in said and "resumed from" in said, said[-3000:]
    assert [m["guard"]["update"] for m in metrics(branch) if m["step"] == spike] == ["rewound"]

    interrupted = tmp_path / "interrupted"
    first = launch(2, dataset, interrupted, *guard, "guard.action=rewind", warm=True)
    said = ""
    while "rewinding to step" not in said:
        line = first.stdout.readline()
        assert line, said[-3000:]
        said += line
    first.send_signal(signal.SIGTERM)
    said += first.communicate(timeout=120)[0]
    assert first.returncode == 75, said[-3000:]  # preempted: a scheduler requeues it
    relaunched = launch(2, dataset, interrupted, *guard, "guard.action=rewind", warm=True)
    relaunched.communicate(timeout=300)
    assert relaunched.returncode == again.returncode
    assert steps(interrupted) == steps(manual)


def test_a_dashboard_whose_package_is_missing_or_whose_settings_are_wrong_is_refused_in_one_line(monkeypatch, tmp_path):
    """log.tensorboard or log.wandb without its package, or log.wandb with settings wandb.init does not take or that
    the checkpoint decides: one line saying what to do, before any step."""
    from tokstream.errors import UserError
    from tokstream.train.config import load_config
    from tokstream.train.dashboards import DashboardState, Dashboards, Takeover

    fresh = Takeover(0, False, None)
    for setting, package in (("log.tensorboard=tb", "tensorboard"), ("log.wandb={project: p}", "wandb")):
        monkeypatch.setitem(sys.modules, package, None)  # import fails, as where it is not installed
        config = load_config(None, [setting, "data.remote=d"])
        with pytest.raises(UserError) as refused:
            Dashboards.open(config, DashboardState(), fresh, str(tmp_path), master=True)
        key = setting.partition("=")[0]
        assert str(refused.value) == (f"{key} needs the {package} package: pip install 'tokstream[dashboards]', or "
                                      f"unset {key}")
        monkeypatch.delitem(sys.modules, package)
    for settings, said in (("{project: p, resume: must}", "log.wandb.resume: the run's W&B id and branch are kept in "
                                                          "its checkpoints; leave resume out"),
                           ("{project:p}", "log.wandb holds 'project:p', which wandb.init does not take (YAML reads "
                                           "{project:p} as one key: put a space after the colon); give wandb.init's "
                                           "settings, e.g. {project: gpt2, entity: me}")):
        with pytest.raises(UserError) as refused:
            Dashboards.open(load_config(None, [f"log.wandb={settings}", "data.remote=d"]), DashboardState(), fresh,
                            str(tmp_path), master=True)
        assert str(refused.value) == said
    other_rank = Dashboards.open(load_config(None, ["log.tensorboard=tb", "data.remote=d"]), DashboardState(), fresh,
                                 str(tmp_path), master=False)
    assert other_rank.tensorboard is None and not (tmp_path / "tb").exists()  # every other rank writes nothing


def test_dashboards_turned_off_for_a_branch_hold_no_step_of_another_when_turned_on_again(dataset, tmp_path):
    """Trained to 12 with TensorBoard and W&B; rewound to 4 and trained to 12 again with both off; then both on again
    to step 16. TensorBoard shows steps 1-4 and 13-16, each once, with this branch's losses (5-12 of the first branch
    purged, the branch's own never given to it); the W&B run of the first launch is not continued (it holds the
    other branch's 5-12): a branch forked from it at step 4 holds 13-16. The last launch's first line says it took
    over after the run's end."""
    import numpy as np
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tokstream.testing.wandb_files import history, run_record

    run_dir = tmp_path / "run"
    common = ("max_steps=12", "keep_checkpoints=0")
    on = (f"log.tensorboard={run_dir / 'tb'}", "log.wandb={project: tokstream-tests}")
    finish(launch_to(1, dataset, run_dir, *common, *on, env=OFFLINE, warm=True))
    finish(launch_to(1, dataset, run_dir, *common, "resume_from=4", warm=True))
    finish(launch_to(1, dataset, run_dir, *common, "resume_from=4", "max_steps=16", *on, env=OFFLINE, warm=True))
    branch = metrics(run_dir)
    assert branch[12]["relaunch"] == {"from_step": 12, "after": "end"}
    board = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0}, purge_orphaned_data=True)
    board.Reload()
    assert [(event.step, event.value) for event in board.Scalars("loss")] == \
        [(m["step"], float(np.float32(m["loss"]))) for m in branch if m["step"] <= 4 or m["step"] > 12]
    runs = {run_record(path).run_id: path for path in (run_dir / "wandb").glob("offline-run-*/run-*.wandb")}
    assert len(runs) == 2
    (first,) = [name for name, path in runs.items() if not run_record(path).branch_point.run]
    (forked,) = [path for name, path in runs.items() if name != first]
    assert (run_record(forked).branch_point.run, run_record(forked).branch_point.value) == (first, 4)
    assert [h["_step"] for h in history(runs[first])] == list(range(1, 13))
    assert [(h["_step"], h["loss"]) for h in history(forked)] == [(m["step"], m["loss"]) for m in branch[12:]]
