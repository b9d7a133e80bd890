"""Training-data throughput: the project's loader vs stock StreamingDataset vs litData vs nanoGPT's get_batch.

    python bench/loader.py                  # builds a 100 M-token dataset from ../shared/corpora
    python bench/loader.py --data DIR       # an existing converted dataset (its train split)
    python bench/loader.py --remote         # also: the dataset served from S3 on 127.0.0.1, cold cache
    pip install -e .[bench]                 # litData, the peer (measured when installed)

All read the same 1,025-token uint16 samples, shuffled, batch 16, one process (plus its DataLoader
workers), and are timed over the same number of batches after the first:
- project: tokstream/train's TokenDataset + StreamingDataLoader with the settings train/main.py
           uses (data.DataConfig's defaults; workers write into the shared ring, as in training),
           and with workers also the same loader with its transfers pickled (the path before the ring),
           the two alternately --repeat times each, medians;
- stock:   streaming.StreamingDataset + StreamingDataLoader with the default collate;
- litdata: litData's StreamingDataset + TokensLoader + its StreamingDataLoader, over the same
           samples written by litdata.optimize, with its default shuffle (chunks in a shuffled
           order, the samples of the chunks at hand interleaved), not streaming's global shuffle;
- memmap:  nanoGPT's get_batch (memmap per batch, torch.randint offsets, int64 x and y) on the
           same shards' token regions.
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a clone without installing; bench/ itself is the script's folder

BATCH = 16


def build_dataset(out: Path, million_tokens: int) -> None:
    from bin_speed import build_bin

    from tokstream.options import ConversionOptions
    from tokstream.token_conversion import Vocabulary, convert_token_files
    from tokstream.tokenizer import load_tokenizer
    from tokstream.token_files import open_token_file

    build_bin(out.with_suffix(".bin"), million_tokens)
    convert_token_files({"train": [open_token_file(out.with_suffix(".bin"))]}, str(out),
                        Vocabulary.of(load_tokenizer("gpt2")), ConversionOptions(block_size=1024, progress=False))
    out.with_suffix(".bin").unlink()


def timed_batches(batches, count: int) -> float:
    """Tokens/s over `count` batches, after taking (and not timing) the first."""
    iterator = iter(batches)
    next(iterator)
    started = time.perf_counter()
    tokens = 0
    for _ in range(count):
        batch = next(iterator)
        tokens += batch.get("counted", batch["tokens"].numel())  # block + 1 tokens per sample for all three
    return tokens / (time.perf_counter() - started)


def project_loader(remote: str, local: str | None, workers: int, reuse_slots: bool = True):
    """Training's loader: DataConfig's defaults, and worker transfers through the shared ring
    (reuse_slots, as TrainBatches has it); reuse_slots=False: pickled through the pipe instead."""
    from tokstream.reader.config import DataConfig
    from tokstream.reader.batches import make_loader

    config = DataConfig(remote=remote, local=local, num_workers=workers)  # training's defaults
    return make_loader(config, "train", BATCH, shuffle=True, pin_memory=False, reuse_slots=reuse_slots)


def litdata_samples(root: str):
    """litdata.optimize's fn (module level: its workers are spawned): the split's samples, in order."""
    from tokstream.verify import iter_split_samples

    for array in iter_split_samples(Path(root), "train", []):
        for sample in array:
            yield torch.from_numpy(sample.astype(np.int64)).to(torch.uint16)


def build_litdata(root: Path, out: Path) -> None:
    """The train split's samples as litData chunks of whole 1,025-token samples."""
    import litdata

    litdata.optimize(fn=litdata_samples, inputs=[str(root)], output_dir=str(out), chunk_size=1025 * 8192,
                     item_loader=litdata.TokensLoader(), num_workers=1, verbose=False)
    written = litdata.StreamingDataset(str(out), item_loader=litdata.TokensLoader(block_size=1025))
    ours = next(litdata_samples(str(root)))
    assert torch.equal(written[0], ours), "litData's first sample differs from the dataset's"
    print(f"litdata: {len(written):,} samples of 1,025 tokens written by litdata.optimize, the first checked equal")


def litdata_batches(optimized: Path, workers: int):
    import litdata

    dataset = litdata.StreamingDataset(str(optimized), item_loader=litdata.TokensLoader(block_size=1025),
                                       shuffle=True, drop_last=True)
    for batch in litdata.StreamingDataLoader(dataset, batch_size=BATCH, num_workers=workers, drop_last=True):
        yield {"tokens": batch}


def litdata_installed() -> bool:
    try:
        import litdata  # noqa: F401
    except ImportError:
        print("litdata is not installed (pip install -e .[bench]): the peer is left out")
        return False
    return True


def stock_loader(remote: str, local: str | None, workers: int):
    from streaming import StreamingDataLoader, StreamingDataset

    is_url = "://" in remote
    dataset = StreamingDataset(remote=remote if is_url else None, local=local if is_url else remote, split="train",
                               shuffle=True, shuffle_seed=9176, num_canonical_nodes=1, batch_size=BATCH)
    return StreamingDataLoader(dataset, batch_size=BATCH, num_workers=workers, drop_last=True)


def memmap_batches(root: Path):
    """nanoGPT's get_batch, verbatim in its logic, over the same shards' token regions.

    Each shard's samples form a contiguous run of tokens; like nanoGPT it re-opens the memmap
    every batch, draws random offsets with torch.randint and builds int64 inputs and targets.
    """
    regions = []
    for path in sorted((root / "train").glob("shard.*.mds")):
        header = np.fromfile(path, dtype=np.uint32, count=2)  # sample count, offset of sample 0
        regions.append((path, int(header[1]), int(header[0]) * 1025))
    block = 1024
    while True:
        path, offset, length = regions[int(torch.randint(len(regions), (1,)))]
        data = np.memmap(path, dtype=np.uint16, mode="r", offset=offset, shape=(length,))
        ix = torch.randint(length - block, (BATCH,))
        x = torch.stack([torch.from_numpy(data[i : i + block].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + block].astype(np.int64)) for i in ix])
        yield {"tokens": x, "targets": y, "counted": BATCH * (block + 1)}

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=None, help="converted dataset root (default: build one)")
    parser.add_argument("--tokens", type=int, default=100, help="millions of tokens when building")
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=4, help="runs of each, with workers: ring vs pickled")
    parser.add_argument("--remote", action="store_true", help="also measure from S3 on loopback, cold cache")
    args = parser.parse_args()

    # Download-ahead threads may still be filling a cache when the directory is removed.
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        root = Path(args.data) if args.data else Path(tmp) / "ds"
        if not args.data:
            build_dataset(root, args.tokens)
        peer = litdata_installed()
        if peer:
            build_litdata(root, Path(tmp) / "litdata")
        rates: dict[str, float] = {}
        pickled: dict[int, float] = {}  # the project's workers without the ring: transfers pickled
        for workers in (0, 1, 2, 8):  # 8: what users set by habit
            if workers:  # ring and pickled alternately, medians: their difference is within one run's noise here
                runs = {ring: [] for ring in (True, False)}
                for turn in range(args.repeat):
                    for ring in (True, False) if turn % 2 == 0 else (False, True):
                        runs[ring].append(timed_batches(project_loader(str(root), None, workers, ring), args.batches))
                rates[f"project workers={workers}"] = statistics.median(runs[True])
                pickled[workers] = statistics.median(runs[False])
            else:
                rates["project workers=0"] = timed_batches(project_loader(str(root), None, 0), args.batches)
            rates[f"stock   workers={workers}"] = timed_batches(stock_loader(str(root), None, workers), args.batches)
            if peer:
                rates[f"litdata workers={workers}"] = timed_batches(litdata_batches(Path(tmp) / "litdata", workers),
                                                                    args.batches)
        rates["memmap get_batch"] = timed_batches(memmap_batches(root), args.batches)
        report("local dataset", rates)
        print("  project workers, transfers pickled through the pipe: "
              + " ".join(f"{w}={r / 1e6:.2f} M" for w, r in pickled.items()))
        print("  ratio_ring_vs_pickled: "
              + " ".join(f"{w}={rates[f'project workers={w}'] / r:.2f}" for w, r in pickled.items()))
        if args.remote:
            remote_rates(root, Path(tmp), args.batches, rates["memmap get_batch"])


def report(title: str, rates: dict[str, float]) -> None:
    print(f"== {title}: tokens/s, batch {BATCH} x 1025, shuffled")
    for name, rate in rates.items():
        print(f"  {name:22s} {rate / 1e6:8.2f} M")
    kinds = [kind for kind in ("project", "stock", "litdata") if any(n.startswith(kind) for n in rates)]
    best = {kind: max((r, n) for n, r in rates.items() if n.startswith(kind)) for kind in kinds}
    memmap = rates.get("memmap get_batch")
    print("  best: " + ", ".join(f"{kind} {best[kind][1].split()[-1]}" for kind in kinds))
    ratios = [f"ratio_vs_{kind}={best['project'][0] / best[kind][0]:.2f}" for kind in kinds[1:]]
    print("  " + " ".join(ratios) + (f" ratio_vs_memmap={best['project'][0] / memmap:.2f}" if memmap else ""))
    if "litdata" in best and "project workers=0" in rates:  # training's default against litData at its best
        print(f"  ratio_training_default_vs_litdata_best={rates['project workers=0'] / best['litdata'][0]:.2f}")
    for kind in kinds:  # item 3 of the reader's goals: workers at least as fast as none
        alone = rates.get(f"{kind:7s} workers=0")
        with_workers = {n.split("=")[-1]: r / alone for n, r in rates.items() if n.startswith(kind) and alone}
        if len(with_workers) > 1:
            print(f"  {kind} workers_vs_in_process: " + " ".join(f"{w}={r:.2f}" for w, r in with_workers.items()))


def remote_rates(root: Path, tmp: Path, batches: int, memmap_rate: float) -> None:
    """The same dataset uploaded to S3 on 127.0.0.1, each loader from its own cold cache."""
    from tokstream.object_store import S3Dataset
    from tokstream.testing.loopback_s3 import start_loopback_s3

    start_loopback_s3("bench")  # stays up until the process ends (see below)
    store = S3Dataset("s3://bench/ds")
    for path in sorted(root.rglob("*")):
        if path.is_file():
            store.upload(path, path.relative_to(root).as_posix())
    rates = {}
    workers = 0  # the default, by the local measurement
    rates[f"project workers={workers}"] = timed_batches(project_loader("s3://bench/ds", str(tmp / "c1"), workers),
                                                        batches)
    rates[f"stock   workers={workers}"] = timed_batches(stock_loader("s3://bench/ds", str(tmp / "c2"), workers),
                                                        batches)
    rates["memmap get_batch"] = memmap_rate  # local, from the run above: the ceiling
    report("S3 on 127.0.0.1, cold cache (memmap: local, same run)", rates)
    # The server stays up until the process ends: the loaders' download-ahead threads may still be
    # fetching shards past the measured batches.


if __name__ == "__main__":
    from tokstream.testing.lock_files import removing_new_lock_files

    with removing_new_lock_files():
        main()
