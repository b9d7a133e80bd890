"""Order files' builder (tokstream/reader/order/order_files.py's build_ahead): the process every launch starts to build
the next epoch's order, as it is now and with what it imported until 2026-11-28 (streaming and torch, which the
reader package imported eagerly), alternating, in the same run. Each trial builds one epoch of py1e (`auto`'s order
for data that fits) over a dataset of --samples samples into a fresh folder. Printed: CPU seconds and peak memory of
the builder process, medians.

    ./dev python bench/order_builder.py --trials 5
"""

import argparse
import pickle
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WAYS = {
    "now": "",
    "streaming and torch first": "import tokstream.reader.batches; ",
}
BUILD = "{first}import runpy; runpy.run_module('tokstream.reader.order.order_files', run_name='__main__')"


def inputs(samples: int):
    from tokstream.reader.order.order_files import OrderInputs
    from tokstream.reader.streaming_door import order_file_sequence

    shards = np.full(samples // 1000, 1000, np.int64)
    return OrderInputs(shards, [len(shards)], [samples], "balanced", 1, False, True, "py1e", 9176, 8, 1 << 18,
                       order_file_sequence)


def cpu_s(way: str, payload: bytes) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", BUILD.format(first=WAYS[way])], input=payload, cwd=ROOT, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--samples", type=int, default=100_000)
    args = parser.parse_args()
    order = inputs(args.samples)
    cpu = {way: [] for way in WAYS}
    for trial in range(args.trials):
        for way in WAYS:
            with tempfile.TemporaryDirectory() as folder:
                cpu[way].append(cpu_s(way, pickle.dumps((order, 1, folder))))
                assert any(Path(folder).glob("order-*-epoch-1.npy")), "the builder built nothing"
    peak = {}
    for way in WAYS:  # alone in a process of its own, so that its peak is its own
        code = (f"import resource, subprocess, sys; subprocess.run([sys.executable, '-c', {BUILD.format(first=WAYS[way])!r}],"
                " stdin=sys.stdin, check=True); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
        with tempfile.TemporaryDirectory() as folder:
            done = subprocess.run([sys.executable, "-c", code], input=pickle.dumps((order, 1, folder)), cwd=ROOT,
                                  capture_output=True, check=True)
        peak[way] = int(done.stdout.split()[-1]) / 1024
    print(f"{'builder':<26} {'CPU s':>6} {'peak MB':>8}   (median of {args.trials}, {args.samples:,} samples)")
    for way in WAYS:
        print(f"{way:<26} {statistics.median(cpu[way]):6.2f} {peak[way]:8.0f}")
    now, before = (statistics.median(cpu[way]) for way in WAYS)
    print(f"now/before: CPU {now / before:.2f}, peak memory {peak['now'] / peak['streaming and torch first']:.2f}")


if __name__ == "__main__":
    main()
