"""A training rank's exit: Python's normal teardown vs tokstream's exit_without_teardown, in the same run.

Each trial is a process that does what a rank has done by its end (imports torch, builds the tiny GPT and its
AdamW, trains a step: the optimizer imports torch._dynamo) and then exits, one way or the other, alternating. Printed:
the seconds from its last line to its end (the wall time every launch, preemption and requeue waits) and its CPU
seconds in all, medians over the trials.

    ./dev python bench/rank_exit.py --trials 5
"""

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RANK = r"""
import sys, time
import torch
from tokstream.train.config import ModelConfig
from tokstream.train.model import GPT
from tokstream.train.process_exit import exit_without_teardown

model = GPT(ModelConfig(vocab_size=50257, block_size=64, n_layer=2, n_head=2, n_embd=64))  # configs/tiny.yaml
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, 50257, (4, 64))
model(ids, ids).backward()
optimizer.step()
print(time.time(), flush=True)
if sys.argv[1] == "without-teardown":
    exit_without_teardown(0)
sys.exit(0)
"""


def trial(way: str) -> tuple[float, float]:
    """(seconds from the process's last line to its end, its CPU seconds)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, "-c", RANK, way], cwd=ROOT, capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    ended = time.time()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return ended - float(done.stdout.split()[-1]), cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=5, help="processes each way, alternating")
    args = parser.parse_args()
    ways = ("normal", "without-teardown")
    results = {way: [] for way in ways}
    for _ in range(args.trials):
        for way in ways:
            results[way].append(trial(way))
    medians = {way: (statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows))
               for way, rows in results.items()}
    print(f"{'exit':>18} {'last line to end s':>19} {'process CPU s':>14}")
    for way, (tail, cpu) in medians.items():
        print(f"{way:>18} {tail:19.2f} {cpu:14.2f}")
    normal, fast = medians["normal"], medians["without-teardown"]
    print(f"saved per rank: {normal[0] - fast[0]:.2f} s of wall, {normal[1] - fast[1]:.2f} s of CPU "
          f"(ratio without/normal: wall {fast[0] / normal[0]:.2f}, CPU {fast[1] / normal[1]:.2f})")


if __name__ == "__main__":
    main()
