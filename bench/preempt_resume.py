"""A real training run preempted with SIGTERM and relaunched, compared step by step with the same run uninterrupted.

    python bench/preempt_resume.py --dataset data/corpora --config configs/gpt2-124m-shared.yaml   # one GPU
    python bench/preempt_resume.py --dataset demo/data --config configs/tiny.yaml --nproc 2 max_steps=40

Both runs are launched as a user launches them (torchrun, train/main.py, sample tracing on). The
second gets SIGTERM from outside once its metrics pass --preempt-at, checkpoints at the next step
boundary, exits, and is relaunched with the same command. The table says, per step, whether the
sample ids match (they must) and whether the losses are bitwise equal (or by how much they differ).
Both loss curves go to --plot.
"""

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a clone without installing

from tokstream.train.metrics import read_records  # noqa: E402
from train.plot import plot_runs  # noqa: E402


def torchrun(nproc: int, config: str, run_dir: Path, overrides: list[str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(ROOT / "train/main.py"), config, *overrides, f"run_dir={run_dir}", "trace_samples=true"]
    print("$", " ".join(command[2:]), flush=True)
    return subprocess.Popen(command, cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen) -> str:
    output, _ = process.communicate()
    if process.returncode != 0:
        sys.exit(f"error: training exited with {process.returncode}:\n{output[-3000:]}")
    return output


records = read_records


def preempted_run(nproc: int, config: str, run_dir: Path, overrides: list[str], preempt_at: int) -> float:
    """Train, SIGTERM torchrun once step `preempt_at` is logged, relaunch; the seconds from signal to exit."""
    process = torchrun(nproc, config, run_dir, overrides)
    while not records(run_dir) or records(run_dir)[-1]["step"] < preempt_at:
        if process.poll() is not None:
            sys.exit(f"error: the run ended before step {preempt_at}:\n{process.stdout.read()[-3000:]}")
        time.sleep(0.05)
    signalled = time.perf_counter()
    process.send_signal(signal.SIGTERM)  # torchrun forwards it to every rank, as on a preemption notice
    output, _ = process.communicate()  # torchrun itself exits non-zero after a signal
    exit_seconds = time.perf_counter() - signalled
    saved = [line for line in output.splitlines() if "preempted" in line]
    if not saved:
        sys.exit(f"error: no preemption checkpoint after SIGTERM:\n{output[-3000:]}")
    print(saved[0], flush=True)
    print(finish(torchrun(nproc, config, run_dir, overrides)).splitlines()[-1], flush=True)
    return exit_seconds


def compare(reference: list[dict], resumed: list[dict], preempt_at: int) -> None:
    if [r["step"] for r in reference] != [r["step"] for r in resumed]:
        sys.exit("error: the two runs logged different steps")
    print(f"{len(reference)} steps; SIGTERM after step {preempt_at}, relaunched from the checkpoint it made")
    print(f"same sample ids at every step: {sum(a['samples'] == b['samples'] for a, b in zip(reference, resumed))}"
          f"/{len(reference)}")
    last = reference[-1]["step"]
    for part, pairs in ((f"steps 1-{preempt_at}", [(a, b) for a, b in zip(reference, resumed) if a["step"] <= preempt_at]),
                        (f"steps {preempt_at + 1}-{last}", [(a, b) for a, b in zip(reference, resumed)
                                                            if a["step"] > preempt_at])):
        differences = [abs(a["loss"] - b["loss"]) for a, b in pairs]
        val = [abs(a["val_loss"] - b["val_loss"]) for a, b in pairs if "val_loss" in a]
        print(f"{part:>12s}: losses bitwise equal at {differences.count(0.0)}/{len(pairs)} steps, "
              f"max |difference| {max(differences):.3g}; val_loss bitwise equal {val.count(0.0)}/{len(val)}"
              + (f", max |difference| {max(val):.3g}" if val else ""))
    median = len(reference) // 2
    print(f"loss: first {reference[0]['loss']:.4f}, last {reference[-1]['loss']:.4f}; median tokens/s "
          f"{sorted(r['tokens_per_s'] for r in reference)[median]:,.0f}"
          + (f", median MFU {sorted(r['mfu'] for r in reference)[median]:.1%}" if "mfu" in reference[0] else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", required=True, help="a converted dataset root (data.remote)")
    parser.add_argument("--config", default=str(ROOT / "configs/gpt2-124m-shared.yaml"))
    parser.add_argument("--nproc", type=int, default=1, help="ranks (torchrun --nproc_per_node)")
    parser.add_argument("--preempt-at", type=int, default=None, help="SIGTERM after this step (default: 45%%)")
    parser.add_argument("--workdir", default=None, help="where the two run directories go (default: temporary)")
    parser.add_argument("--plot", default="loss.png", help="PNG of both runs' loss curves")
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value, as for train/main.py")
    args = parser.parse_args()

    from tokstream.train.config import load_config

    overrides = [*args.overrides, f"data.remote={args.dataset}"]
    steps = load_config(args.config, overrides).max_steps
    preempt_at = args.preempt_at or steps * 45 // 100
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        reference_dir, resumed_dir = Path(tmp) / "uninterrupted", Path(tmp) / "preempted"
        started = time.perf_counter()
        print(finish(torchrun(args.nproc, args.config, reference_dir, overrides)).splitlines()[-1], flush=True)
        print(f"uninterrupted run: {time.perf_counter() - started:.0f} s")
        exit_seconds = preempted_run(args.nproc, args.config, resumed_dir, overrides, preempt_at)
        print(f"SIGTERM to exit (checkpoint included): {exit_seconds:.1f} s")
        compare(records(reference_dir), records(resumed_dir), preempt_at)
        plot_runs([str(reference_dir), str(resumed_dir)], args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    from tokstream.testing.lock_files import removing_new_lock_files

    with removing_new_lock_files():
        main()
