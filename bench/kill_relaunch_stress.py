"""Hard-kill and relaunch a training run many times next to another live streaming job.

    python bench/kill_relaunch_stress.py                 # 20 cycles, 2 CPU ranks, the tiny config
    python bench/kill_relaunch_stress.py --cycles 5

Each cycle relaunches the run, lets it train a step or two past where it was, then SIGKILLs every
process of it at once (as node loss or a cgroup OOM kill does: streaming's shared memory is left
behind). Meanwhile another job reads the same dataset through stock StreamingDataset and keeps its
blocks mapped. Checked: every relaunch starts (the stale blocks of this run are removed, the other
job's are untouched), the run ends at max_steps, and its samples and losses equal an uninterrupted
run's, step for step.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a clone without installing

from tokstream.testing.processes import kill_tree  # noqa: E402
from tokstream.train.metrics import read_records  # noqa: E402

SHARED_CORPUS = ROOT.parent / "shared/corpora/tinyshakespeare.txt"
OTHER_JOB = """
import sys
from streaming import StreamingDataset
from tokstream.reader.streaming_door.streaming_internals import shm_prefix
dataset = StreamingDataset(local=sys.argv[1], split="train", shuffle=False, batch_size=1)
next(iter(dataset))
print(f"{shm_prefix(dataset):06}", flush=True)
sys.stdin.readline()
"""


def torchrun(dataset: Path, run_dir: Path, steps: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(ROOT / "train/main.py"), str(ROOT / "configs/tiny.yaml"), f"data.remote={dataset}",
               f"run_dir={run_dir}", f"max_steps={steps}", f"optim.decay_steps={steps}", "checkpoint_interval=2",
               "eval_interval=0", "trace_samples=true"]
    return subprocess.Popen(command, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def steps_done(run_dir: Path) -> list[tuple]:
    return [(r["step"], r["samples"], r["loss"]) for r in read_records(run_dir)]


def other_jobs_blocks(prefix: str) -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob(f"{prefix}_*"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--corpus", default=str(SHARED_CORPUS))
    args = parser.parse_args()

    from tokstream.convert.options import ConversionOptions
    from tokstream.convert.sources import open_source
    from tokstream.convert.text_one_pass import convert_documents
    from tokstream.tokenizer import load_tokenizer

    steps = 4 * args.cycles + 6  # a cycle advances the run by 3 steps at most
    with tempfile.TemporaryDirectory() as tmp:
        dataset = Path(tmp) / "ds"
        convert_documents(open_source([args.corpus], txt_docs="paragraph"), load_tokenizer("gpt2"), str(dataset),
                          ConversionOptions(block_size=64, shard_size="64kb", progress=False))
        reference_dir = Path(tmp) / "reference"
        if torchrun(dataset, reference_dir, steps).wait() != 0:
            sys.exit("error: the uninterrupted run failed")

        other = subprocess.Popen([sys.executable, "-c", OTHER_JOB, str(dataset)], cwd=ROOT, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        prefix = other.stdout.readline().strip()
        blocks_before = other_jobs_blocks(prefix)
        run_dir, started = Path(tmp) / "run", time.perf_counter()
        try:
            for cycle in range(1, args.cycles + 1):
                process = torchrun(dataset, run_dir, steps)
                target = len(steps_done(run_dir)) + 2
                while len(steps_done(run_dir)) < target:
                    if process.poll() is not None:
                        sys.exit(f"error: cycle {cycle}: the relaunch failed:\n{process.stdout.read()[-3000:]}")
                    time.sleep(0.05)
                kill_tree(process.pid)
                process.communicate()
                print(f"cycle {cycle:2d}: killed at step {len(steps_done(run_dir))}", flush=True)
            if torchrun(dataset, run_dir, steps).wait() != 0:
                sys.exit("error: the last relaunch failed")
            same = steps_done(run_dir) == steps_done(reference_dir)
            intact = other_jobs_blocks(prefix) == blocks_before
            print(f"{args.cycles} hard kills and relaunches in {time.perf_counter() - started:.0f} s; "
                  f"every relaunch started; final run equals the uninterrupted one (samples, losses): {same}; "
                  f"the other job's {len(blocks_before)} shared-memory blocks untouched: {intact}")
            if not intact:
                print(f"the other job's blocks before: {blocks_before}; after: {other_jobs_blocks(prefix)}")
            if not (same and intact):
                sys.exit(1)
        finally:
            other.communicate("done\n")


if __name__ == "__main__":
    from tokstream.testing.lock_files import removing_new_lock_files

    with removing_new_lock_files():
        main()
