"""Training-data throughput: the project's loader vs stock StreamingDataset vs litData vs nanoGPT's get_batch.

    python bench/loader.py                  # builds a 100 M-token dataset from ../shared/corpora
    python bench/loader.py --data DIR       # an existing converted dataset (its train split)
    python bench/loader.py --remote         # also: the dataset served from S3 on 127.0.0.1, cold cache
    python bench/loader.py --documents      # only: TrainBatches with and without each batch's documents
    pip install -e .[bench]                 # litData, the peer (measured when installed)

All read the same 1,025-token uint16 samples, shuffled, batch 16, one process (plus its DataLoader
workers: 0, 1, 2, 8 and os.cpu_count()), and are timed over the same number of batches after the
first, each row in a fresh process of this script (no leftover threads of another loader, and stock
streaming as shipped: the project's replacements are put in place only where its reader is built). Before any timing the script prints one line of settings per reader and checks that litData
(every worker count timed) and the project's reader read the dataset's samples over one epoch.
- project: tokstream.reader's loader (make_loader: TokenDataset + TokenLoader) with the settings
           training uses (DataConfig's defaults; workers write into the shared ring, as in training),
           and with workers also the same loader with its transfers pickled (the path before the ring),
           the two alternately --repeat times each, medians;
- stock:   streaming.StreamingDataset + StreamingDataLoader with the default collate;
- litdata: litData as its documentation recommends for token datasets (LLM pre-training), at its
           defaults otherwise. Written by litdata.optimize(chunk_bytes="64MB",
           item_loader=TokensLoader()) from the split's samples in order (whole samples per chunk);
           read by StreamingDataset(dir, item_loader=TokensLoader(block_size=1025), shuffle=True)
           with StreamingDataLoader(batch_size=16, num_workers=N): its own shuffle (chunks in a
           shuffled order, the samples of the chunks at hand interleaved, not streaming's global
           shuffle), seed 42, drop_last False (one process), max_pre_download 2, chunks memory-mapped
           in place (its POSIX-fast path for a local directory), its collate, prefetch_factor 2 with
           workers. Its docs use num_workers=os.cpu_count() (among the counts timed) and pin_memory
           for a GPU; no reader here pins (pin_memory=False for all);
- memmap:  nanoGPT's get_batch (memmap per batch, torch.randint offsets, int64 x and y) on the
           same shards' token regions.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a clone without installing; bench/ itself is the script's folder

BATCH = 16
SAMPLE = 1025  # tokens: block 1024 + 1
WORKERS = sorted({0, 1, 2, 8, os.cpu_count() or 1})  # 8: what users set by habit; os.cpu_count(): litData's docs
LITDATA_CHUNK_BYTES = "64MB"  # the chunk size litData's README recommends (and calls its default)


def build_dataset(out: Path, million_tokens: int) -> None:
    from bin_speed import build_bin

    from tokstream.convert.options import ConversionOptions
    from tokstream.convert.token_conversion import Vocabulary, convert_token_files
    from tokstream.convert.token_files import open_token_file
    from tokstream.tokenizer import load_tokenizer

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
    from tokstream.reader.batches import make_loader
    from tokstream.reader.config import DataConfig

    config = DataConfig(remote=remote, local=local, num_workers=workers)  # training's defaults
    return make_loader(config, "train", BATCH, shuffle=True, pin_memory=False, reuse_slots=reuse_slots)


def litdata_samples(root: str):
    """litdata.optimize's fn (module level: its workers are spawned): the split's samples, in order."""
    from tokstream.convert.verify import iter_split_samples

    for array in iter_split_samples(Path(root), "train", []):
        for sample in array:
            yield torch.from_numpy(sample.astype(np.int64)).to(torch.uint16)


def build_litdata(root: Path, out: Path) -> None:
    """The train split's samples as litData chunks, written as its docs recommend for tokens: chunk_bytes
    "64MB" and TokensLoader() (each chunk one flat array of tokens; whole samples per chunk, so every
    1,025-token block read back is one sample: check_same_samples asserts it)."""
    import litdata

    # One input (the dataset): one writer, the samples in the dataset's order.
    litdata.optimize(fn=litdata_samples, inputs=[str(root)], output_dir=str(out), chunk_bytes=LITDATA_CHUNK_BYTES,
                     item_loader=litdata.TokensLoader(), num_workers=1, verbose=False)


def litdata_loader(optimized: Path, workers: int):
    """litData's recommended read of token chunks; everything else at its defaults."""
    import litdata

    dataset = litdata.StreamingDataset(str(optimized), item_loader=litdata.TokensLoader(block_size=SAMPLE),
                                       shuffle=True)
    return litdata.StreamingDataLoader(dataset, batch_size=BATCH, num_workers=workers)


def litdata_batches(optimized: Path, workers: int):
    for batch in litdata_loader(optimized, workers):
        yield {"tokens": batch}


READERS = ("project", "project-pickled", "train-batches", "train-batches-documents", "stock", "litdata", "memmap")


def train_batches(root: str, documents: bool):
    """tokstream.reader.TrainBatches (what a training loop iterates), with or without each micro-batch's documents
    (document attention), at data.max_documents' default."""
    from tokstream.reader import BatchPlan, DataConfig, TrainBatches, open_dataset

    return TrainBatches(open_dataset(DataConfig(remote=root)), BatchPlan(BATCH, BATCH, 1),
                        max_documents=DataConfig().max_documents if documents else None)


def reader_batches(reader: str, source: str, workers: int):
    """The batches of one row's reader; `source`: the dataset root (litData's chunks for litdata)."""
    if reader in ("project", "project-pickled"):
        return project_loader(source, None, workers, reuse_slots=reader == "project")
    if reader.startswith("train-batches"):
        return train_batches(source, documents=reader.endswith("documents"))
    if reader == "stock":
        return stock_loader(source, None, workers)
    if reader == "litdata":
        return litdata_batches(Path(source), workers)
    return memmap_batches(Path(source))


def fresh_rate(reader: str, source: Path, workers: int, batches: int) -> float:
    """A reader's tokens/s, timed in a fresh process of this script (--rate). In one process, the loaders
    timed before leave their download-ahead threads running after their last batch (after stock's
    workers=0 run they used about 40% of a core with the process otherwise idle), and a reader built
    there once puts the project's replacements into streaming (streaming_door.install()), so stock's
    row would not be stock's: every row starts from nothing."""
    command = [sys.executable, __file__, "--rate", reader, "--source", str(source), "--workers", str(workers),
               "--batches", str(batches)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{reader} workers={workers}: its timing process failed ({done.returncode}):\n"
                         f"{done.stderr[-3000:]}")
    return float(done.stdout.split()[-1])


def litdata_installed() -> bool:
    try:
        import litdata  # noqa: F401
    except ImportError:
        print("litdata is not installed (pip install -e .[bench]): the peer is left out")
        return False
    return True


def sample_counts(arrays: Iterable[np.ndarray]) -> Counter:
    """The multiset of samples (rows) as counts of their 128-bit hashes."""
    import xxhash

    counts: Counter = Counter()
    for array in arrays:
        if array.dtype != np.uint16 or array.ndim != 2 or array.shape[1] != SAMPLE:
            raise SystemExit(f"bench: a batch of {array.dtype} {array.shape}, not uint16 samples of {SAMPLE} tokens")
        for row in np.ascontiguousarray(array):
            counts[xxhash.xxh3_128_intdigest(row)] += 1
    return counts


def tensors_as_arrays(batches: Iterable) -> Iterator[np.ndarray]:
    for batch in batches:
        yield (batch["tokens"] if isinstance(batch, dict) else batch).numpy()


def check_same_samples(root: Path, optimized: Path | None) -> None:
    """One epoch of litData (each worker count timed) must give the dataset's samples, each as often as the
    dataset has it; the project's reader the same, less the partial last batch it leaves out. Stops the
    bench on a mismatch: a rate over other samples compares nothing."""
    from tokstream.convert.verify import iter_split_samples

    problems: list[str] = []
    dataset = sample_counts(iter_split_samples(root, "train", problems))
    if problems:
        raise SystemExit(f"bench: the dataset fails its checks ({problems[0]}); nothing measured")
    total = dataset.total()
    if optimized is not None:
        for workers in WORKERS:
            read = sample_counts(tensors_as_arrays(litdata_loader(optimized, workers)))
            if read != dataset:
                raise SystemExit(
                    f"MISMATCH litdata workers={workers}: one epoch gave {read.total():,} samples, the dataset has "
                    f"{total:,}; {(dataset - read).total():,} of the dataset's not read, {(read - dataset).total():,} "
                    f"read that are not the dataset's. The bench stops: its rates would not compare the same samples")
        print(f"litdata: one epoch at workers={'/'.join(map(str, WORKERS))} reads the dataset's samples exactly: "
              f"the same multiset of {total:,} ({len(dataset):,} distinct), by 128-bit hashes")
    project = sample_counts(tensors_as_arrays(project_loader(str(root), None, 0)))
    left_out = dataset - project
    if project - dataset or left_out.total() != total % BATCH:
        raise SystemExit(
            f"MISMATCH project: one epoch gave {project.total():,} samples, {(project - dataset).total():,} not the "
            f"dataset's, {left_out.total():,} of the dataset's left out (expected {total % BATCH}, its partial last "
            f"batch). The bench stops")
    print(f"project: one epoch reads {project.total():,} of the dataset's samples, the {total % BATCH} of the "
          f"partial last batch left out")


def print_settings(root: Path, optimized: Path | None, repeat: int) -> None:
    """One line per reader: how it stores and reads, from the objects the timed runs build."""
    from tokstream.reader.config import DataConfig

    project = project_loader(str(root), None, 0).dataset
    shards = project.shards
    print(f"settings: batch {BATCH} x {SAMPLE} tokens, shuffled, workers {'/'.join(map(str, WORKERS))}, "
          f"pin_memory=False for all, each row timed in a fresh process")
    print(f"  project: MDS shards of the converter ({len(shards)}, size_limit {shards[0].size_limit:,} B); "
          f"make_loader, DataConfig's defaults: shuffle=True algo={project.shuffle_algo} "
          f"seed={project.shuffle_seed} shuffle_block_size={project.shuffle_block_size} "
          f"num_canonical_nodes={project.num_canonical_nodes} predownload={project.predownload} "
          f"cache_limit={project.cache_limit} prefetch_factor={DataConfig().prefetch_factor} (torch's 2 with "
          f"workers); with workers: shared ring and pickled, alternately {repeat} runs each, medians; "
          f"partial last batch dropped")
    stock = stock_loader(str(root), None, 1)
    data = stock.dataset
    print(f"  stock:   the same shards; streaming.StreamingDataset(shuffle=True algo={data.shuffle_algo} "
          f"seed={data.shuffle_seed} shuffle_block_size={data.shuffle_block_size} "
          f"num_canonical_nodes={data.num_canonical_nodes} batch_size={data.batch_size} "
          f"predownload={data.predownload}) + StreamingDataLoader(batch_size={stock.batch_size}, default collate, "
          f"drop_last={stock.drop_last}, prefetch_factor={stock.prefetch_factor} with workers)")
    if optimized is not None:
        import json

        index = json.loads((optimized / "index.json").read_text())
        first = index["chunks"][0]
        loader = litdata_loader(optimized, 1)
        data = loader.dataset
        place = f"POSIX-fast {data.posix_fast.kind}: chunks mmapped in place" if data.posix_fast else "chunks cached"
        print(f"  litdata: optimize(chunk_bytes=\"{LITDATA_CHUNK_BYTES}\", "
              f"item_loader={index['config']['item_loader']}()) -> {len(index['chunks'])} chunks, the first "
              f"{first['chunk_size']:,} samples ({first['chunk_bytes']:,} B); StreamingDataset(item_loader="
              f"{type(data.item_loader).__name__}(block_size={data.item_loader._block_size}), "
              f"shuffle={data.shuffle} seed={data.seed} drop_last={data.drop_last} "
              f"max_pre_download={data.max_pre_download}, {place}) + StreamingDataLoader(batch_size="
              f"{loader.batch_size}, its collate, prefetch_factor={loader.prefetch_factor} with workers); "
              f"its docs' workers: os.cpu_count()={os.cpu_count()}")
    print(f"  memmap:  nanoGPT's get_batch: a random shard's token region memmapped per batch, {BATCH} offsets "
          f"from torch.randint, block {SAMPLE - 1}, int64 x and y, in-process; not an epoch (offsets drawn with "
          f"replacement)")


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
    parser.add_argument("--documents", action="store_true",
                        help="only the cost of document structure: training's loader with and without it")
    parser.add_argument("--rate", choices=READERS, help=argparse.SUPPRESS)  # fresh_rate's process
    parser.add_argument("--source", help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rate:
        print(timed_batches(reader_batches(args.rate, args.source, args.workers), args.batches))
        return

    # Download-ahead threads may still be filling a cache when the directory is removed.
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        root = Path(args.data) if args.data else Path(tmp) / "ds"
        if not args.data:
            build_dataset(root, args.tokens)
        if args.documents:
            return document_rates(root, args.batches, args.repeat)
        peer = litdata_installed()
        optimized = Path(tmp) / "litdata" if peer else None
        if optimized is not None:
            build_litdata(root, optimized)
        print_settings(root, optimized, args.repeat)
        check_same_samples(root, optimized)  # stops the bench on a mismatch, before any timing
        rates: dict[str, float] = {}
        pickled: dict[int, float] = {}  # the project's workers without the ring: transfers pickled
        for workers in WORKERS:
            if workers:  # ring and pickled alternately, medians: their difference is within one run's noise here
                runs = {ring: [] for ring in (True, False)}
                for turn in range(args.repeat):
                    for ring in (True, False) if turn % 2 == 0 else (False, True):
                        reader = "project" if ring else "project-pickled"
                        runs[ring].append(fresh_rate(reader, root, workers, args.batches))
                rates[f"project workers={workers}"] = statistics.median(runs[True])
                pickled[workers] = statistics.median(runs[False])
            else:
                rates["project workers=0"] = fresh_rate("project", root, 0, args.batches)
            rates[f"stock   workers={workers}"] = fresh_rate("stock", root, workers, args.batches)
            if peer:
                rates[f"litdata workers={workers}"] = fresh_rate("litdata", optimized, workers, args.batches)
        rates["memmap get_batch"] = fresh_rate("memmap", root, 0, args.batches)
        report("local dataset", rates)
        print("  project workers, transfers pickled through the pipe: "
              + " ".join(f"{w}={r / 1e6:.2f} M" for w, r in pickled.items()))
        print("  ratio_ring_vs_pickled: "
              + " ".join(f"{w}={rates[f'project workers={w}'] / r:.2f}" for w, r in pickled.items()))
        if args.remote:
            remote_rates(root, Path(tmp), args.batches, rates["memmap get_batch"])


def document_rates(root: Path, batches: int, repeat: int) -> None:
    """TrainBatches in-process with and without each micro-batch's documents, alternately, medians."""
    runs = {reader: [] for reader in ("train-batches", "train-batches-documents")}
    for turn in range(repeat):
        for reader in runs if turn % 2 == 0 else reversed(list(runs)):
            runs[reader].append(fresh_rate(reader, root, 0, batches))
    plain, documents = (statistics.median(runs[reader]) for reader in runs)
    print(f"== document structure: tokens/s, batch {BATCH} x 1025, shuffled, in-process, median of {repeat}")
    print(f"  TrainBatches workers=0            {plain / 1e6:8.2f} M")
    print(f"  TrainBatches workers=0 +documents {documents / 1e6:8.2f} M")
    print(f"  ratio_documents_vs_without={documents / plain:.2f}")


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
