"""The lazy order against streaming's order as the dataset grows: a rank's first batch and memory at 8.8 M, 88 M and
880 M samples (9 B, 90 B and 0.9 T tokens at block 1,024), fresh, resumed at 50 % and at the second epoch's start.

    python bench/lazy_scale.py                              # 8.8 M, 88 M, 880 M samples; 1 and 8 ranks
    python bench/lazy_scale.py --million-samples 8.8 88 --ranks 1

The datasets are built without a terabyte of disk: one real shard of 64 MB is converted by bin_to_mds.py from a
sparse .bin, and every other shard is a copy of it whose header is written and whose token bytes are a hole in the
file (all zeros, which the reader does not care about). So every shard is byte for byte the first, its hash in the
index is right, and convert/verify.py would pass it.

Each row is the slowest of the ranks started together (bench/scale.py's rank processes, with torchrun's
environment): seconds from every rank's imports to its first batch, its peak RSS (imports included) and the
node's /dev/shm. The orders, in the same run: "lazy" (data.shuffle_algo: lazy, tokstream/reader/order/
lazy.py), "py1e" (streaming's order computed in memory by the project's reader, as a reader without
data.order_dir does) and "file" (py1e kept as files, data.order_dir, as the trainer does: the first start builds the
epoch's file, the next ones map it, the second epoch's is built ahead), the latter two up to --py1e-limit samples
(beyond, computing py1e needs minutes and more memory than this machine's 24 GB); stock StreamingDataset at the
smallest size. Which of them `auto`, the default, reads each dataset in is said. The curve goes to --plot (PNG).
"""

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a clone without installing

from tokstream.reader.config import DataConfig  # noqa: E402  (auto's threshold: which order the default reads in)


def _scale():
    """bench/scale.py, whose rank processes this benchmark starts as it does (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location("scale", ROOT / "bench" / "scale.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


scale = _scale()
BLOCK, GLOBAL_BATCH, run_ranks = scale.BLOCK, scale.GLOBAL_BATCH, scale.run_ranks

SHARD_TOKENS = 32_000 * (BLOCK + 1)  # about 64 MB of uint16 tokens: one shard


def template(workdir: Path) -> Path:
    """One real shard (a dataset of one), from a sparse .bin."""
    source = workdir / "one.bin"
    with open(source, "wb") as out:
        out.truncate(SHARD_TOKENS * 2)
    subprocess.run([sys.executable, str(ROOT / "convert/bin_to_mds.py"), str(source), "--out", str(workdir / "one"),
                    "--block-size", str(BLOCK), "--no-progress", "--shard-size", "80mb"], check=True,
                   stdout=subprocess.DEVNULL)
    source.unlink()
    return workdir / "one"


def build(one: Path, root: Path, samples: int) -> tuple[int, float]:
    """A dataset of copies of `one`'s shard (sparse bodies), at least `samples` samples; its sample count and the
    seconds it took."""
    started = time.perf_counter()
    index = json.loads((one / "train" / "index.json").read_text())
    shard = index["shards"][0]
    per_shard = shard["samples"]
    count = -(-samples // per_shard)
    source = one / "train" / shard["raw_data"]["basename"]
    size = source.stat().st_size
    with open(source, "rb") as handle:
        header = handle.read(4 + 4 * (per_shard + 1) + 4096)  # the offsets, and more: all that is not a hole
    header = header.rstrip(b"\0") or header
    (root / "train").mkdir(parents=True)
    shards = []
    for number in range(count):
        name = f"shard.{number:05d}.mds" if number < 100_000 else f"shard.{number:06d}.mds"
        with open(root / "train" / name, "wb") as out:
            out.write(header)
            out.truncate(size)
        shards.append({**shard, "raw_data": {**shard["raw_data"], "basename": name}})
    (root / "train" / "index.json").write_text(json.dumps({**index, "shards": shards}))
    metadata = json.loads((one / "metadata.json").read_text())
    train = metadata["splits"]["train"]
    metadata["splits"] = {"train": {**train, "samples": count * per_shard, "tokens": train["tokens"] * count}}
    (root / "metadata.json").write_text(json.dumps(metadata))
    return count * per_shard, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--million-samples", type=float, nargs="+", default=[8.8, 88, 880])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--py1e-limit", type=float, default=100e6, help="largest dataset (samples) py1e runs on")
    parser.add_argument("--workdir", default=None, help="where datasets are built (default: beside the clone)")
    parser.add_argument("--plot", default="bench/lazy_scale.png")
    args = parser.parse_args()

    rows = []
    print(f"{'samples':>12} {'order':>6} {'ranks':>5} {'start':>6} {'first_batch_s':>13} {'rss_peak_mb':>11} "
          f"{'shm_node_mb':>11}", flush=True)
    with tempfile.TemporaryDirectory(dir=args.workdir or ROOT.parent) as workdir:
        one = template(Path(workdir))
        for million in args.million_samples:
            root = Path(workdir) / f"ds-{million:g}M"
            samples, built_s = build(one, root, int(million * 1e6))
            epoch = samples // GLOBAL_BATCH * GLOBAL_BATCH
            print(f"# {samples:,} samples in {samples // 32_000:,} shards, built in {built_s:.0f} s; epochs of "
                  f"{epoch:,}", flush=True)
            default = "lazy" if samples >= DataConfig().lazy_order_from else "py1e, kept as files by the trainer"
            print(f"# data.shuffle_algo: auto (the default) reads this dataset in: {default}", flush=True)
            orders = [("project", "lazy", "lazy"), ("project", "feistel_window", "fwin")]  # today's, the first
            if samples <= args.py1e_limit:
                orders += [("project", "py1e", "py1e"), ("project", "py1e", "file")]
            if million == min(args.million_samples) and samples <= args.py1e_limit:  # stock: as py1e, and slower
                orders.append(("stock", "py1e", "stock"))
            for ranks in args.ranks:
                for reader, algo, label in orders:
                    order_dir = Path(workdir) / f"orders-{million:g}M-{ranks}" if label == "file" else None
                    for name, position, epoch_number in STARTS[label]:
                        if name == "built" and order_dir is not None:  # ahead, while the last epoch was read
                            waited = wait_for_file(order_dir, 1)
                            print(f"# the second epoch's order file was ready {waited:.1f} s after the first "
                                  "epoch's readers stopped", flush=True)
                        reports, shm = run_ranks(root, epoch, ranks, position, reader, algo, epoch_number, order_dir)
                        worst = max(r["first_batch_s"] for r in reports)
                        rss = max(r["rss_peak_mb"] for r in reports)
                        rows.append({"samples": samples, "order": label, "ranks": ranks, "start": name,
                                     "first_batch_s": worst, "rss_peak_mb": rss, "shm_node_mb": shm / 2**20})
                        print(f"{samples:>12,} {label:>6} {ranks:>5} {name:>6} {worst:13.2f} {rss:11.0f} "
                              f"{shm / 2**20:11.1f}", flush=True)
            print(f"# the ledger's SampleOrder, lazy order, a step half-way through the second epoch on 8 ranks: "
                  f"{ledger_step_s(root, epoch):.2f} s (open and answer)", flush=True)
            shutil.rmtree(root)
    print()
    for samples in sorted({r["samples"] for r in rows}):
        for ranks in args.ranks:
            def first(order: str, starts: tuple = ("fresh", "50%", "epoch2", "built")) -> float | None:
                times = [r["first_batch_s"] for r in rows if (r["samples"], r["ranks"], r["order"]) == (samples, ranks,
                                                                                                         order)
                         and r["start"] in starts]
                return max(times) if times else None
            lazy, py1e, stock, file = first("lazy"), first("py1e"), first("stock"), first("file")
            ratios = [f"ratio_lazy_vs_{name}={lazy / other:.3f}" for name, other in (("py1e", py1e), ("stock", stock))
                      if other]
            if file:
                ratios.append(f"ratio_py1e_file_relaunch_vs_py1e={file / py1e:.3f} (the file's build: "
                              f"{first('file', ('build',)):.2f} s, once per epoch)")
            print(f"{samples:,} samples, {ranks} rank(s): slowest lazy first batch {lazy:.2f} s "
                  + " ".join(ratios), flush=True)
    plot(rows, args.plot)
    print(f"wrote {args.plot}; goals: lazy first_batch_s < 2 and rss_peak_mb < 1024 at every size")


# Each order's starts: (name, position in the epoch, epoch). With files: the first start builds epoch 0's order
# ("build"); a relaunch maps it ("fresh", "50%"); epoch 1's was built ahead meanwhile ("built", at the epoch's start).
STARTS = {"lazy": (("fresh", 0.0, 0), ("50%", 0.5, 0), ("epoch2", 0.0, 1)),
          "fwin": (("fresh", 0.0, 0), ("50%", 0.5, 0), ("epoch2", 0.0, 1)),
          "py1e": (("fresh", 0.0, 0), ("50%", 0.5, 0), ("epoch2", 0.0, 1)),
          "file": (("build", 0.0, 0), ("fresh", 0.0, 0), ("50%", 0.5, 0), ("built", 0.0, 1)),
          "stock": (("fresh", 0.0, 0), ("50%", 0.5, 0))}


def wait_for_file(order_dir: Path, epoch: int) -> float:
    """Seconds until the epoch's order file (built ahead by a process the first epoch's reader started) is there."""
    started = time.perf_counter()
    while not list(order_dir.glob(f"order-*-epoch-{epoch}.npy")):
        time.sleep(0.1)
    return time.perf_counter() - started


LEDGER_SCRIPT = r"""
import sys, time
started = time.perf_counter()
from tokstream.reader import DataConfig, SampleOrder, open_dataset
imported = time.perf_counter()
root, step, global_batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
order = SampleOrder(open_dataset(DataConfig(remote=root, shuffle_algo="lazy")), global_batch)
read = order.steps(step, 1, 1, 8)
assert read.shape == (1, 8, global_batch // 8) and read.min() >= 0
print(time.perf_counter() - imported)
order.close()
"""


def ledger_step_s(root: Path, epoch: int) -> float:
    """Seconds to open the dataset's SampleOrder (the ledger's) in the lazy order and say one step's samples, after
    imports, in a process of its own (a parent's peak RSS would be its children's starting one)."""
    done = subprocess.run([sys.executable, "-c", LEDGER_SCRIPT, str(root), str(epoch // GLOBAL_BATCH * 3 // 2),
                           str(GLOBAL_BATCH)], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    return float(done.stdout.strip().splitlines()[-1])


def plot(rows: list[dict], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (time_axis, memory_axis) = plt.subplots(1, 2, figsize=(11, 4.5))
    for order in ("lazy", "py1e", "file", "stock"):
        for ranks in sorted({r["ranks"] for r in rows}):
            chosen = [r for r in rows if r["order"] == order and r["ranks"] == ranks and r["start"] != "build"]
            if not chosen:
                continue
            sizes = sorted({r["samples"] for r in chosen})
            worst = [max(r["first_batch_s"] for r in chosen if r["samples"] == s) for s in sizes]
            memory = [max(r["rss_peak_mb"] for r in chosen if r["samples"] == s) for s in sizes]
            label = f"{'py1e from its file' if order == 'file' else order}, {ranks} rank{'s' * (ranks > 1)}"
            time_axis.plot(sizes, worst, "o-", label=label)
            memory_axis.plot(sizes, memory, "o-", label=label)
    for axis, what in ((time_axis, "first batch, slowest start (s)"), (memory_axis, "peak RSS per rank (MB)")):
        axis.set_xscale("log")
        axis.set_xlabel("samples in the dataset (block 1,024)")
        axis.set_ylabel(what)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out, dpi=110)


if __name__ == "__main__":
    from tokstream.testing.lock_files import removing_new_lock_files

    with removing_new_lock_files():
        main()
