"""The reader at OpenWebText scale: first batch, memory per rank, shared memory per node, the checker's time.

    python bench/scale.py                                   # 9.04 B tokens, 1 and 8 ranks (17 GB of disk)
    python bench/scale.py --million-tokens 1000 --ranks 1 2 # smaller
    python bench/scale.py --repeat 3                        # each start three times

The dataset is OpenWebText's size (8.82 M samples of 1,025 tokens, 271 shards of 64 MB), converted
by bin_to_mds.py from a sparse .bin, which costs disk but no time to generate (its tokens are all 0,
which the reader does not care about). For each rank count, that many processes start together with
torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT) and build the training
loader as train/main.py does (tokstream/reader/batches.py, micro-batch 12, the epoch training uses: the
split cut to whole steps of configs/gpt2-124m-owt.yaml's 480 samples), fresh or resumed at 10%, 50%
and 90% of the epoch (streaming's state, as a checkpoint holds it). The baseline, in the same run:
stock StreamingDataset and StreamingDataLoader with the same settings, in processes that import
nothing of the project, fresh and at 50%, once each (--no-stock skips it).

Cutting the epoch makes streaming draw a fraction of the stream, which its `get_sampling` adds up
in a Python loop per sample; the fence replaces it with an equal vectorized one
(tokstream/reader/order/sampling.py). Both are timed here on this dataset's shards, same run.

Each rank reports: seconds from its start to the end of its imports; seconds from the moment every
rank has imported (the parent then tells them all to go: on 2 cores, 8 ranks' imports end seconds
apart, and streaming's start-up waits for all of them) to its first batch, which covers building the
loader, the epoch's order and the first read; and its peak RSS, after imports and after the first
batch (the dataset's share is the difference).
The node's shared memory is what /dev/shm holds for the job while every rank has its first batch.

On AMD Zen 4 the project's ranks sort with numpy's AVX2 kernel, as training does (tokstream/train/cpu_dispatch.py),
and stock's with numpy's own choice; `NPY_DISABLE_CPU_FEATURES= python bench/scale.py` measures both
with numpy's own choice.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a clone without installing

from tokstream.train.cpu_dispatch import VARIABLE, on_zen4  # noqa: E402

OWT_SAMPLES = 8_820_000
BLOCK = 1024
MICRO_BATCH = 12
GLOBAL_BATCH = 480  # configs/gpt2-124m-owt.yaml
STOCK_POSITIONS = (0.0, 0.5)  # stock's starts, once each (it takes seconds each)

RANK_SCRIPT = r"""
import json, os, resource, sys, time
started = time.monotonic()
root, samples, position, micro_batch, reader = (sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]),
                                                sys.argv[5])
algo, epoch = sys.argv[6], int(sys.argv[7])
order_dir = sys.argv[8] if len(sys.argv) > 8 and sys.argv[8] else None  # the project's orders kept as files
if reader == "project":
    from tokstream.train.cpu_dispatch import prefer_avx2_sort
    prefer_avx2_sort()  # as train/main.py does first
    from tokstream.reader.config import DataConfig
    from tokstream.reader.batches import make_loader
else:  # stock streaming: nothing of the project imported, so none of its replacements in force
    from streaming import Stream, StreamingDataLoader, StreamingDataset
if int(os.environ["WORLD_SIZE"]) > 1:  # as training does (distributed.py), before it builds its loader
    import torch.distributed
    torch.distributed.init_process_group("gloo")
print(json.dumps({"start_s": time.monotonic() - started,
                  "rss_imports_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}), flush=True)
sys.stdin.readline()  # every rank has imported: the reader's own time starts now, on all of them
go = time.monotonic()
if reader == "project":
    loader = make_loader(DataConfig(remote=root, shuffle_algo=algo, order_dir=order_dir), "train", micro_batch,
                         shuffle=True, pin_memory=False, choose=[samples])
else:  # the same settings as DataConfig's defaults
    dataset = StreamingDataset(streams=[Stream(local=root, split="train", choose=samples)], shuffle=True,
                               shuffle_seed=9176, num_canonical_nodes=1, batch_size=micro_batch)
    loader = StreamingDataLoader(dataset, batch_size=micro_batch, num_workers=0, drop_last=True)
if position or epoch:
    loader.load_state_dict({"epoch": epoch, "sample_in_epoch": int(samples * position), "num_canonical_nodes": 1,
                            "shuffle_seed": 9176, "initial_physical_nodes": 1})
next(iter(loader))
print(json.dumps({"first_batch_s": time.monotonic() - go,
                  "rss_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}), flush=True)
sys.stdin.readline()  # hold the shared memory until the parent has measured it
"""


def build(workdir: Path, million_tokens: int) -> tuple[Path, float]:
    """A sparse .bin converted to MDS; the conversion's seconds."""
    source = workdir / "owt.bin"
    with open(source, "wb") as out:
        out.truncate(million_tokens * 1_000_000 * 2)
    started = time.perf_counter()
    subprocess.run([sys.executable, str(ROOT / "convert/bin_to_mds.py"), str(source), "--out", str(workdir / "ds"),
                    "--block-size", str(BLOCK), "--no-progress"], check=True,
                   stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - started
    source.unlink()
    return workdir / "ds", seconds


def shm_bytes() -> dict[str, int]:
    return {p.name: p.stat().st_size for p in Path("/dev/shm").iterdir() if p.is_file()}


def run_ranks(root: Path, samples: int, ranks: int, position: float, reader: str, algo: str = "py1e",
              epoch: int = 0, order_dir: Path | None = None) -> tuple[list[dict], int]:
    """Start `ranks` processes together; their reports and the shared memory they added. `order_dir`: the project
    reader's epoch orders kept as files there (data.order_dir)."""
    from tokstream.testing.loopback_s3 import free_port

    before = shm_bytes()
    processes = []
    port = str(free_port())  # streaming joins the ranks in a process group, as under torchrun
    for rank in range(ranks):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1",
                   PYTHONPATH=str(ROOT))
        if reader == "stock":  # stock's collate warns of the read-only arrays it gets, at every batch
            env["PYTHONWARNINGS"] = "ignore::UserWarning"
        processes.append(subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(root), str(samples),
                                           str(position), str(MICRO_BATCH), reader, algo, str(epoch),
                                           str(order_dir or "")], env=env,
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
    reports = [json.loads(process.stdout.readline()) for process in processes]  # imported
    for process in processes:
        process.stdin.write("go\n")
        process.stdin.flush()
    for process, report in zip(processes, reports):
        report.update(json.loads(process.stdout.readline()))  # first batch
    added = sum(size for name, size in shm_bytes().items() if name not in before)
    for process in processes:
        process.communicate("done\n", timeout=120)
    return reports, added


def numpy_sort() -> str:
    if VARIABLE in os.environ:
        return f"numpy's kernels: as {VARIABLE}={os.environ[VARIABLE]!r} says, in every reader"
    if on_zen4():
        return "numpy's sort: AVX2 in the project's ranks (AMD Zen 4: tokstream/train/cpu_dispatch.py), AVX-512 in stock's"
    return "numpy's sort: numpy's own choice in every reader"


def start_name(position: float) -> str:
    return "fresh" if not position else f"{position:.0%}"


def sampling_times(root: Path, epoch: int) -> str:
    """streaming's get_sampling against the fence's, on this dataset's shard sizes, for the cut epoch."""
    from tokstream.reader.order.sampling import get_sampling_vectorized
    from tokstream.reader.streaming_door.streaming_internals import stock_get_sampling

    index = json.loads((root / "train" / "index.json").read_text())
    shards = np.array([shard["samples"] for shard in index["shards"]], dtype=np.int64)
    times, results = [], []
    for function in (stock_get_sampling, get_sampling_vectorized):
        started = time.perf_counter()
        results.append(function(shards, epoch, 1, 9176, 0, True))
        times.append(time.perf_counter() - started)
    assert (results[0] == results[1]).all()
    return (f"streaming get_sampling {times[0]:.2f} s, vectorized {times[1]:.2f} s, same counts per shard: "
            f"ratio_vectorized_vs_stock={times[1] / times[0]:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--million-tokens", type=int, default=OWT_SAMPLES * BLOCK // 1_000_000 + 1)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--workdir", default=None, help="where the dataset is built (default: beside the clone)")
    parser.add_argument("--dataset", default=None, help="reuse a dataset this benchmark built (skips build, verify)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each start, one row each (the spread)")
    parser.add_argument("--no-stock", dest="stock", action="store_false",
                        help="skip the baseline: stock StreamingDataset and StreamingDataLoader, fresh and at 50%%")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(dir=args.workdir or ROOT.parent) as workdir:
        if args.dataset:
            root = Path(args.dataset)
        else:
            root, convert_s = build(Path(workdir), args.million_tokens)
        samples = json.loads((root / "metadata.json").read_text())["splits"]["train"]["samples"]
        epoch = samples // GLOBAL_BATCH * GLOBAL_BATCH
        print(f"dataset: {samples:,} samples of {BLOCK + 1} tokens, {len(list((root / 'train').glob('shard.*')))} "
              f"shards; epochs of {epoch:,} (whole steps of {GLOBAL_BATCH})\n{numpy_sort()}", flush=True)
        if not args.dataset:
            started = time.perf_counter()
            subprocess.run([sys.executable, str(ROOT / "convert/verify.py"), str(root)], check=True,
                           stdout=subprocess.DEVNULL)
            print(f"bin_to_mds.py {convert_s:.1f} s, verify.py {time.perf_counter() - started:.1f} s", flush=True)
        print(f"\n{'reader':>7} {'ranks':>5} {'start':>6} {'start_s':>7} {'first_batch_s':>13} {'rss_imports_mb':>14} "
              f"{'rss_peak_mb':>11} {'dataset_mb':>10} {'shm_node_kb':>11}")
        first_batch: dict[tuple[str, int, float], list[float]] = {}  # the slowest rank's, per run
        for ranks in args.ranks:
            runs = [("project", p) for p in (0.0, 0.1, 0.5, 0.9) for _ in range(args.repeat)]
            runs += [("stock", p) for p in STOCK_POSITIONS] if args.stock else []
            for reader, position in runs:
                reports, shm = run_ranks(root, epoch, ranks, position, reader)
                worst = max(reports, key=lambda r: r["first_batch_s"])
                fattest = max(reports, key=lambda r: r["rss_peak_mb"] - r["rss_imports_mb"])
                first_batch.setdefault((reader, ranks, position), []).append(worst["first_batch_s"])
                print(f"{reader:>7} {ranks:>5} {start_name(position):>6} {max(r['start_s'] for r in reports):7.2f} "
                      f"{worst['first_batch_s']:13.2f} {fattest['rss_imports_mb']:14.0f} "
                      f"{fattest['rss_peak_mb']:11.0f} "
                      f"{fattest['rss_peak_mb'] - fattest['rss_imports_mb']:10.0f} {shm / 1024:11.1f}", flush=True)
        print()
        for ranks in args.ranks:
            seconds = [s for (reader, r, _), each in first_batch.items() if reader == "project" and r == ranks
                       for s in each]
            print(f"{ranks} rank(s), first_batch_s of the slowest rank over {len(seconds)} runs: "
                  f"min {min(seconds):.2f} median {np.median(seconds):.2f} max {max(seconds):.2f}, under 1 s in "
                  f"{sum(s < 1 for s in seconds)}/{len(seconds)}")
            if args.stock:
                ratios = [f"{start_name(p)}="
                          f"{np.median(first_batch['project', ranks, p]) / first_batch['stock', ranks, p][0]:.3f}"
                          for p in STOCK_POSITIONS]
                print(f"  ratio_project_vs_stock first batch (project's median run): {' '.join(ratios)}")
        # Last: the parent's memory would otherwise be the ranks' starting peak RSS (inherited at fork).
        print("\n" + sampling_times(root, epoch), flush=True)
    print("worst rank shown; goals: first_batch_s < 1, dataset_mb <= 300 per rank")


if __name__ == "__main__":
    from tokstream.testing.lock_files import removing_new_lock_files

    with removing_new_lock_files():
        main()
