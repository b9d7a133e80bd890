"""Used by the converters (parts of a job array) and the trainer (ranks started by srun): what Slurm's
environment says about this process: which part of a conversion an array task is, and the rank and
world of a task that `srun` started without torchrun.

Read here only, so that converters and the trainer agree. Nothing is guessed from a batch script's own
shell: a rank comes from a task of a job step (SLURM_STEP_ID is set by srun, not in the batch script).
"""

import os
import re

from tokstream.errors import UserError


def array_part(part: str | None, num_parts: int | None, environ=os.environ) -> tuple[str | None, int | None]:
    """(part, num_parts) for a conversion in parts run as a Slurm job array: task I converts part I where the
    command asks for parts (--num-parts N without --part: in an array, not every part in every task) or says
    `--part array`. Without --num-parts, `--part array` takes N from the array, which must be exactly 0..N-1
    of two tasks or more (a resubmitted element is a one-task array: it must say --num-parts). Anything else,
    or outside an array, is returned unchanged: an array whose tasks convert corpora of their own stays so."""
    task = environ.get("SLURM_ARRAY_TASK_ID")
    if part == "array" and task is None:
        raise UserError("--part array reads SLURM_ARRAY_TASK_ID, and this is not a task of a Slurm job array")
    if task is None or not (part == "array" or (part is None and num_parts is not None)):
        return part, num_parts
    if num_parts is None:
        count, first, last = (int(environ.get(name, -1)) for name in
                              ("SLURM_ARRAY_TASK_COUNT", "SLURM_ARRAY_TASK_MIN", "SLURM_ARRAY_TASK_MAX"))
        if count < 2 or not (first == 0 and last == count - 1):
            raise UserError(f"this Slurm array's tasks are {first}-{last} ({count} of them), not 0-N with N > 0: "
                            "give --num-parts N, and task I converts part I of N")
        num_parts = count
    if not 0 <= int(task) < num_parts:
        raise UserError(f"Slurm array task {task} is not a part of --num-parts {num_parts}: submit "
                        f"--array=0-{num_parts - 1} (or a subset, to redo parts)")
    return task, num_parts


def ranks_from_srun(environ=os.environ) -> dict[str, str]:
    """torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) for a task that srun started
    directly; {} where torchrun set them or this is not an srun task. MASTER_ADDR and MASTER_PORT are the
    job script's to export (examples/slurm/train.sbatch), since every node must agree on them."""
    if "RANK" in environ or "SLURM_STEP_ID" not in environ or "SLURM_PROCID" not in environ:
        return {}
    world = int(environ.get("SLURM_STEP_NUM_TASKS", environ.get("SLURM_NTASKS", "1")))
    if world == 1:
        return {}  # one process: no process group to join, as `python train/main.py` alone
    per_node = set(tasks_per_node(environ.get("SLURM_STEP_TASKS_PER_NODE", environ.get("SLURM_TASKS_PER_NODE",
                                                                                       str(world)))))
    if len(per_node) != 1:
        raise UserError(f"the srun step runs {environ.get('SLURM_STEP_TASKS_PER_NODE')} tasks per node: every "
                        "node must run the same number of ranks (srun --ntasks-per-node)")
    if not (environ.get("MASTER_ADDR") and environ.get("MASTER_PORT")):
        raise UserError("srun started this rank without MASTER_ADDR and MASTER_PORT: export them in the job "
                        "script (the first node of the job and a free port; see examples/slurm/train.sbatch)")
    return {"RANK": environ["SLURM_PROCID"], "WORLD_SIZE": str(world),
            "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"), "LOCAL_WORLD_SIZE": str(per_node.pop())}


def alone_in_a_bigger_job(environ=os.environ) -> str | None:
    """The line to say when this process trains alone inside a Slurm job of several tasks, started by neither srun
    (which sets SLURM_STEP_NUM_TASKS for each task of its step) nor torchrun: `python train/main.py` in the batch
    script of an `--ntasks=8` job runs once, on one rank, not eight times."""
    tasks = environ.get("SLURM_NTASKS", "1")
    srun_task = "SLURM_STEP_NUM_TASKS" in environ and environ.get("SLURM_STEP_ID", "batch") not in ("batch", "extern")
    if "RANK" in environ or srun_task or not tasks.isdigit() or int(tasks) <= 1:
        return None
    return (f"warning: this Slurm job has {tasks} tasks, but this process was started by neither srun nor torchrun: "
            "it trains alone, on 1 rank; start it with srun (examples/slurm/train.sbatch) to train on all of them")


def tasks_per_node(text: str) -> list[int]:
    """Slurm's compressed task counts, "2(x3),1" -> [2, 2, 2, 1]."""
    counts = []
    for item in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if match is None:
            raise UserError(f"cannot read Slurm's tasks per node {text!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts
