"""A training rank's start-up: its imports with Python's garbage collector as it comes, against
tokstream/train/process_start.py's `start_up_frozen` (paused over the imports, what they made frozen), same run.

Each trial is a process that does what a rank of configs/tiny.yaml does to its first steps (imports torch._dynamo,
which every torch.optim optimizer imports, and the trainer; builds the tiny GPT and its AdamW; trains some steps)
and exits as a rank does, one way or the other, alternating. Printed: its CPU seconds, medians over the trials.

    ./dev python bench/rank_start.py --trials 5 --steps 16
"""

import argparse
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RANK = r"""
import contextlib, sys
from tokstream.train.process_start import start_up_frozen

with start_up_frozen() if sys.argv[1] == "frozen" else contextlib.nullcontext():
    import torch._dynamo
    import tokstream.train.trainer
import torch
from tokstream.train.config import ModelConfig
from tokstream.train.model import GPT
from tokstream.train.process_exit import exit_without_teardown

model = GPT(ModelConfig(vocab_size=50304, block_size=64, n_layer=2, n_head=2, n_embd=64))  # configs/tiny.yaml
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(int(sys.argv[2])):
    ids = torch.randint(0, 50257, (4, 64))
    model(ids, ids).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
exit_without_teardown(0)
"""


def trial(way: str, steps: int) -> float:
    """The process's CPU seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", RANK, way, str(steps)], cwd=ROOT, check=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=5, help="processes each way, alternating")
    parser.add_argument("--steps", type=int, default=16, help="training steps after the start-up")
    args = parser.parse_args()
    ways = ("collector as it comes", "frozen")
    results = {way: [] for way in ways}
    for _ in range(args.trials):
        for way in ways:
            results[way].append(trial(way.split()[0], args.steps))
    medians = {way: statistics.median(rows) for way, rows in results.items()}
    print(f"{'start-up':>22} {'process CPU s':>14}   ({args.steps} steps, medians of {args.trials})")
    for way, cpu in medians.items():
        print(f"{way:>22} {cpu:14.2f}")
    before, after = medians.values()
    print(f"saved per rank: {before - after:.2f} CPU s (ratio frozen/as it comes: {after / before:.2f})")


if __name__ == "__main__":
    main()
