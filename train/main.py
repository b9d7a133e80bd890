"""Train GPT-2 from a converter's MDS dataset; survives preemption and resumes at the exact sample.

    torchrun --nproc_per_node=8 train/main.py configs/gpt2-124m-owt.yaml data.remote=data/owt
    torchrun --nproc_per_node=2 train/main.py configs/tiny.yaml data.remote=demo/data run_dir=demo/run
    srun --ntasks-per-node=8 python train/main.py ...    (Slurm: examples/slurm/train.sbatch)

Relaunching the same command resumes from the newest complete checkpoint in run_dir.
The loop is tokstream/train/trainer.py; the README's "Layout" names the file of each concern.
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone without installing

from tokstream.train.cpu_dispatch import prefer_avx2_sort  # noqa: E402

prefer_avx2_sort()  # before anything imports numpy, which chooses its kernels once (AMD Zen 4 only)

from tokstream.errors import run_cli  # noqa: E402

INTERRUPTED = "interrupted: stopped without a checkpoint; relaunching resumes from the newest one in run_dir"


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if len(sys.argv) > 1 else 2)
    from tokstream.train.config import load_config

    config = load_config(sys.argv[1], sys.argv[2:])  # a mistake in it is said before torch's seconds of imports
    from tokstream.train.process_exit import exit_without_teardown
    from tokstream.train.process_start import start_up_frozen

    with start_up_frozen():  # torch's imports, never walked by the garbage collector (process_start.py)
        import torch._dynamo  # noqa: F401  (the optimizer's first call imports it)

        from tokstream.train.trainer import run_job

    exit_without_teardown(run_job(config))


if __name__ == "__main__":
    # SIGTERM is a preemption notice, handled by the trainer; errors are reported once, by rank 0.
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))  # torchrun's, else srun's
    run_cli(main, sigterm_interrupts=False, report=rank == "0", interrupted=INTERRUPTED)
