"""examples/slurm/ against a real Slurm (the `slurm` fixture: slurmctld, slurmd and munged on 127.0.0.1).

A conversion in parts as a job array with a dependent merge, one part's task cancelled and the whole
submitted again; preemptible training requeued by Slurm, and killed hard then resubmitted; every time the
same bytes or the same steps as without Slurm.
"""

import json
import os
import re
import signal
import sys
from pathlib import Path

import pytest
from conftest import ROOT, run_script, tree_bytes
from test_text_to_mds import ARGS, corpus_files
from test_training import BASE, STEPS, metrics, trained_steps, wait_for

from tokstream.convert.resume import PART_DONE_FILE
from tokstream.errors import UserError
from tokstream.slurm import alone_in_a_bigger_job, array_part, ranks_from_srun, tasks_per_node
from tokstream.testing.loopback_s3 import free_port
from tokstream.testing.processes import notice_when, rank_pids

SLURM = ROOT / "examples" / "slurm"


def job_env(**extra: str) -> dict:
    """What a user's shell hands sbatch: this Python first on PATH, one thread per rank."""
    return {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1", **extra}


def test_a_conversion_array_with_a_cancelled_part_submitted_again_merges_to_the_one_pass_bytes(slurm, tmp_path):
    corpus_files(tmp_path)
    one = run_script("convert/text_to_mds.py", tmp_path / "corpus", "--out", tmp_path / "single", *ARGS)
    assert one.returncode == 0, one.stderr
    out = tmp_path / "multi"
    command = ["bash", str(SLURM / "convert.sh"), "4", str(ROOT / "convert/text_to_mds.py"), str(tmp_path / "corpus"),
               "--out", str(out), *ARGS]

    array, merge = submit(slurm, command, tmp_path)
    # Part 2's task, cancelled as soon as it runs (a lost machine): it ends before its part is done.
    element = f"{array}_2"
    wait_for(lambda: slurm.job(element)["JobState"] == "RUNNING", timeout=120)
    slurm.run("scancel", element)
    parts = out.with_name("multi.parts")
    states = {record["JobId"]: record["JobState"] for record in
              [slurm.wait_for(f"{array}_{i}", {"COMPLETED", "CANCELLED", "FAILED"}) for i in range(4)]}
    assert sorted(states.values()) == ["CANCELLED", "COMPLETED", "COMPLETED", "COMPLETED"], states
    # The merge can never run now (afterok): Slurm cancels it, and no dataset appears.
    assert slurm.wait_for(merge, {"CANCELLED", "COMPLETED", "FAILED"})["JobState"] == "CANCELLED"
    assert not out.exists()
    # Part 2 is cancelled as it runs. On a loaded machine its process can have finished the part (its done file
    # written last) before the signal came, while Slurm still records the task as CANCELLED (seen once in 2026-11-28's
    # runs): then the rerun keeps all four. Either way no other part is missing or converted twice.
    done = sorted(p.parent.name for p in parts.glob(f"*/{PART_DONE_FILE}"))
    assert done in ([f"part-0000{i}-of-00004" for i in (0, 1, 3)], [f"part-0000{i}-of-00004" for i in range(4)]), done

    _, merge = submit(slurm, command, tmp_path)  # the same command again
    assert slurm.wait_for(merge, {"COMPLETED", "CANCELLED", "FAILED"}, timeout=300)["JobState"] == "COMPLETED", \
        slurm.logs()
    logs = {path.name: path.read_text() for path in tmp_path.glob("tokstream-convert-*.out")}
    kept = [text for text in logs.values() if "already complete, kept" in text]
    assert len(kept) == len(done), logs  # the parts done before (0, 1 and 3) were not converted again
    assert tree_bytes(out) == tree_bytes(tmp_path / "single")
    assert not parts.exists()


def submit(slurm, command: list[str], cwd: Path) -> tuple[str, str]:
    """Run examples/slurm/convert.sh; the job ids it prints (the array's, the merge's)."""
    printed = slurm.run(*command, cwd=cwd, env={**slurm.env, **job_env()}).stdout
    array, merge = re.fullmatch(r"parts: job (\d+) \(array 0-\d+\); merge: job (\d+)\n", printed).groups()
    return array, merge


def test_an_array_task_is_its_part_where_parts_are_asked_for_and_refuses_what_it_cannot_be():
    array = {"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_MIN": "0",
             "SLURM_ARRAY_TASK_MAX": "3"}
    assert array_part(None, 4, array) == ("2", 4)  # --num-parts alone: this task's part, not every part
    assert array_part("array", None, array) == ("2", 4) and array_part("array", 8, array) == ("2", 8)
    assert array_part(None, None, array) == (None, None)  # no parts asked for: each task its own corpus, whole
    assert array_part("1", 4, array) == ("1", 4) and array_part("auto", 4, array) == ("auto", 4)  # said: kept
    assert array_part(None, 3, {}) == (None, 3)
    with pytest.raises(UserError, match="--part array reads SLURM_ARRAY_TASK_ID, and this is not a task"):
        array_part("array", 4, {})
    resubmitted = {**array, "SLURM_ARRAY_TASK_COUNT": "1", "SLURM_ARRAY_TASK_MIN": "2", "SLURM_ARRAY_TASK_MAX": "2"}
    assert array_part(None, 4, resubmitted) == ("2", 4)
    first_again = {**array, "SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "1", "SLURM_ARRAY_TASK_MAX": "0"}
    for one_task in (resubmitted, first_again):  # a one-task array cannot say how many parts there are
        with pytest.raises(UserError, match=r"\(1 of them\), not 0-N with N > 0: give --num-parts N"):
            array_part("array", None, one_task)
    with pytest.raises(UserError, match="Slurm array task 2 is not a part of --num-parts 2: submit --array=0-1"):
        array_part(None, 2, array)


def test_srun_tasks_get_torchruns_variables_and_a_batch_script_does_not():
    task = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_TASKS": "4",
            "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "MASTER_ADDR": "gpu-001", "MASTER_PORT": "29500"}
    assert ranks_from_srun(task) == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert ranks_from_srun({**task, "RANK": "0"}) == {}  # torchrun's own variables win
    batch_script = {k: v for k, v in task.items() if k != "SLURM_STEP_ID"}
    assert ranks_from_srun(batch_script) == {}
    with pytest.raises(UserError, match="every node must run the same number of ranks"):
        ranks_from_srun({**task, "SLURM_STEP_TASKS_PER_NODE": "3,1"})
    with pytest.raises(UserError, match="without MASTER_ADDR and MASTER_PORT: export them"):
        ranks_from_srun({k: v for k, v in task.items() if k != "MASTER_ADDR"})
    assert ranks_from_srun({**task, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_TASKS_PER_NODE": "1",
                            "MASTER_ADDR": ""}) == {}  # srun -n 1: one process, no group
    # Inside a bigger allocation (the job's SLURM_NTASKS, SLURM_TASKS_PER_NODE): the step's own count decides.
    allocation = {"SLURM_NTASKS": "8", "SLURM_TASKS_PER_NODE": "4(x2)"}
    assert ranks_from_srun({**task, **allocation, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1",
                            "SLURM_STEP_TASKS_PER_NODE": "1"}) == {}  # srun -n 1 in an 8-task job: no group of 8
    assert ranks_from_srun({**task, **allocation}) == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                                                       "LOCAL_WORLD_SIZE": "2"}
    assert tasks_per_node("8(x3),4") == [8, 8, 8, 4]


def test_srun_steps_smaller_than_their_job_get_their_own_world_through_the_real_slurm(slurm, dataset, tmp_path):
    """In a job of 4 tasks, `srun -n 1 python train/main.py` trains alone (no group of 4 to wait for, no warning that
    it trains alone), and `srun -n 2` is a world of 2: what the real Slurm's variables give ranks_from_srun."""
    import shlex

    script = tmp_path / "steps.sh"
    probe = ("import json; from tokstream.slurm import ranks_from_srun; "
             "print(json.dumps(ranks_from_srun(), sort_keys=True))")
    alone = shlex.join(["python", "train/main.py", *BASE, f"data.remote={dataset}", f"run_dir={tmp_path / 'run'}",
                        "max_steps=2", "optim.decay_steps=2", "eval_interval=0"])
    script.write_text(f"#!/bin/bash\nexport MASTER_ADDR=127.0.0.1 MASTER_PORT={free_port()}\n"
                      # a rank waiting for 3 more would hold the job for the store's 10 minutes: a minute fails it
                      f"timeout 60 srun -n 1 {alone}\nsrun -n 1 python -c '{probe}'\nsrun -n 2 python -c '{probe}'\n")
    log = tmp_path / "steps.out"
    job = slurm.sbatch("--ntasks=4", "--cpus-per-task=1", f"--output={log}", str(script), cwd=ROOT, env=job_env())
    assert slurm.wait_for(job, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=180)["JobState"] == "COMPLETED", \
        log.read_text()
    trained = [record for record in metrics(tmp_path / "run") if "loss" in record]
    assert [(record["step"], record["ranks"]) for record in trained] == [(1, 1), (2, 1)], log.read_text()
    assert "trains alone" not in log.read_text()
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    assert lines[0] == {} and sorted(line["RANK"] for line in lines[1:]) == ["0", "1"], lines
    assert all(line["WORLD_SIZE"] == "2" and line["LOCAL_WORLD_SIZE"] == "2" for line in lines[1:]), lines


def test_a_process_alone_in_a_job_of_several_tasks_says_so_and_an_srun_task_does_not():
    """`python train/main.py` in the batch script of an --ntasks=2 job trains on one rank: said in one line. An srun
    task (each of a step of 4, or the one of `srun -n 1` in a bigger job) and torchrun's ranks say nothing."""
    job = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"}
    assert alone_in_a_bigger_job(job) == (
        "warning: this Slurm job has 2 tasks, but this process was started by neither srun nor torchrun: it trains "
        "alone, on 1 rank; start it with srun (examples/slurm/train.sbatch) to train on all of them")
    assert alone_in_a_bigger_job({**job, "SLURM_STEP_ID": "batch", "SLURM_STEP_NUM_TASKS": "1"}) is not None
    for started in ({"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4"}, {"SLURM_STEP_ID": "3", "SLURM_STEP_NUM_TASKS": "1"},
                    {"RANK": "0"}, {"SLURM_NTASKS": "1"}):
        assert alone_in_a_bigger_job({**job, **started}) is None, started


def submit_training(slurm, dataset: Path, run_dir: Path, log: Path) -> str:
    """examples/slurm/train.sbatch as shipped, on 2 CPU ranks of the test node (no GPUs there)."""
    return slurm.sbatch("--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1", f"--output={log}",
                        str(SLURM / "train.sbatch"), *BASE, f"data.remote={dataset}", f"run_dir={run_dir}",
                        cwd=ROOT, env=job_env(MASTER_PORT=str(free_port())))


def launches(run_dir: Path) -> list[dict]:
    """The `relaunch` record of each launch after the first (metrics.jsonl's first line of a launch)."""
    return [record["relaunch"] for record in metrics(run_dir) if "relaunch" in record]


@pytest.mark.long
def test_a_preempted_job_is_requeued_by_slurm_and_resumes_exactly(slurm, reference, dataset, tmp_path):
    run, log = tmp_path / "run", tmp_path / "job.out"
    job = submit_training(slurm, dataset, run, log)
    # The time limit's notice (--signal=USR1@180, sent now): the ranks save and exit 75; the script requeues.
    notice_when(lambda: rank_pids(run), lambda: len(metrics(run)) >= 3,
                lambda: slurm.run("scancel", "--signal=USR1", job), signal.SIGUSR1)
    slurm.eligible_now(job, restarts=1)
    # A preemption: scontrol requeue sends SIGTERM, and Slurm requeues the job itself.
    first_stop = len(metrics(run))
    notice_when(lambda: rank_pids(run), lambda: len(metrics(run)) >= first_stop + 3,
                lambda: slurm.run("scontrol", "requeue", job),
                signal.SIGTERM)
    slurm.eligible_now(job, restarts=2)
    record = slurm.wait_for(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout=300)
    text = log.read_text()
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == "2", text[-3000:]
    assert "unfinished (exit 75): requeueing job" in text
    assert "Traceback" not in text and "leak" not in text, text[-3000:]  # the notices reached the ranks alone
    # Two launches after the first, each from a step the preemption saved, inside the run. (A notice on a step
    # the periodic checkpoint had saved already is marked "restart", not "preemption": docs/loss-spikes.md.)
    resumed = [r["from_step"] for r in launches(run)]
    assert len(resumed) == 2 and 0 < resumed[0] < resumed[1] < STEPS, text
    assert trained_steps(run) == reference


def test_a_job_killed_hard_and_submitted_again_resumes_from_its_last_checkpoint(slurm, reference, dataset, tmp_path):
    run, log = tmp_path / "run", tmp_path / "job.out"
    job = submit_training(slurm, dataset, run, log)
    notice_when(lambda: rank_pids(run), lambda: (run / "LATEST").exists() and len(metrics(run)) >= 6,
                lambda: slurm.kill_hard(job),
                signal.SIGKILL)
    record = slurm.wait_for(job, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=120)
    assert record["JobState"] == "FAILED", log.read_text()[-3000:]
    assert "preempted" not in log.read_text()  # no rank saw it coming
    saved = max(int(path.name.split("-")[1].split(".")[0]) for path in run.glob("ckpt-*.manifest.json"))

    again = submit_training(slurm, dataset, run, log)
    assert slurm.wait_for(again, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=300)["JobState"] == "COMPLETED"
    assert launches(run)[0]["from_step"] == saved > 0
    assert trained_steps(run) == reference
