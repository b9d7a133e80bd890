"""The end-to-end demo (`./dev demo`): convert, train on 2 CPU ranks, preempt, relaunch, compare.

1. Converts Tiny Shakespeare (../shared/corpora, one document per speech) into demo/data.
2. Trains configs/tiny.yaml uninterrupted with 2 ranks (gloo) into demo/run-reference.
3. Trains it again into demo/run-preempted, sends SIGTERM to torchrun mid-run, relaunches the same command.
4. Checks that both runs consumed the same samples on every rank at every step with bitwise-equal
   losses, and plots both loss curves to demo/loss.png.
"""

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a clone without installing

from tokstream.train.metrics import read_records  # noqa: E402

DEMO = Path(os.environ.get("TOKSTREAM_DEMO_DIR", ROOT / "demo"))  # where it writes (tests: a temporary folder)
CORPUS = ROOT.parent / "shared" / "corpora" / "tinyshakespeare.txt"
STEPS = 30


def torchrun(run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train/main.py",
            "configs/tiny.yaml", f"data.remote={DEMO / 'data'}", f"run_dir={run_dir}", f"max_steps={STEPS}",
            "trace_samples=true"]


def run(command: list[str]) -> None:
    print("$", " ".join(str(c) for c in command), flush=True)
    subprocess.run(command, cwd=ROOT, check=True)


def steps(run_dir: Path) -> list[tuple]:
    return [(r["step"], r["samples"], r["loss"]) for r in read_records(run_dir)]


def echo_without_torchrun_signal_traceback(lines) -> None:
    """Print a run's output, but one line for the traceback torchrun prints on every SIGTERM it forwards."""
    held: list[str] = []
    for line in lines:
        if line.startswith("Traceback (most recent call last)") or held:
            held.append(line)
            if not line[:1].isspace() and "SignalException: " in line:  # the traceback's last line
                print("-- torchrun forwarded SIGTERM to the ranks (it reports that with a SignalException "
                      "traceback, hidden here)", flush=True)
                held = []
            continue
        print(line, end="", flush=True)
    print("".join(held), end="", flush=True)  # any other traceback, in full


def main() -> None:
    if not CORPUS.is_file():
        raise SystemExit(f"error: {CORPUS} not found; pass any text file to convert/owt_to_mds.py instead")
    shutil.rmtree(DEMO, ignore_errors=True)
    run([sys.executable, "convert/owt_to_mds.py", "--dataset", str(CORPUS), "--txt-docs", "paragraph",
         "--out", str(DEMO / "data"), "--block-size", "64", "--val-fraction", "0.05"])
    run([sys.executable, "convert/verify.py", str(DEMO / "data")])

    print("\n== uninterrupted run", flush=True)
    run(torchrun(DEMO / "run-reference"))

    print("\n== the same run, preempted with SIGTERM after step 12, then relaunched", flush=True)
    preempted = DEMO / "run-preempted"
    process = subprocess.Popen(torchrun(preempted), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    echo = threading.Thread(target=echo_without_torchrun_signal_traceback, args=(process.stdout,))
    echo.start()
    metrics = preempted / "metrics.jsonl"
    while not metrics.exists() or len(metrics.read_text().splitlines()) < 12:
        if process.poll() is not None:
            raise SystemExit("error: the training run ended before it could be preempted")
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)  # what Slurm, Kubernetes or a spot reclaim sends
    process.wait()
    echo.join()
    print(f"-- torchrun exited ({process.returncode}); relaunching the very same command", flush=True)
    run(torchrun(preempted))

    reference, resumed = steps(DEMO / "run-reference"), steps(preempted)
    same = sum(a == b for a, b in zip(reference, resumed))
    run([sys.executable, "train/plot.py", str(DEMO / "run-reference"), str(preempted), "--out",
         str(DEMO / "loss.png")])
    if same == STEPS == len(resumed):
        print(f"\nRESUMED RUN MATCHED: {same}/{STEPS} steps consumed the same samples on both ranks with "
              "bitwise-equal losses")
    else:
        raise SystemExit(f"MISMATCH: only {same}/{STEPS} steps matched")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
