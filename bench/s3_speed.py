"""S3 against local, in one run, on an S3 endpoint started here on 127.0.0.1 (moto's server).

    python bench/s3_speed.py              # 40 MB of text; --mb for more

1. Conversion: owt_to_mds.py to a local directory vs to s3:// (uploads while converting).
2. Training reads (StreamingDataset + StreamingDataLoader, shuffled, as train/main.py builds them):
   time to the first batch and steady tokens/s, from a cold cache (everything downloaded) and a
   warm one (shards already local), against the same dataset read from local disk.

Loopback S3 has no network latency or bandwidth limit: these figures isolate the software cost of
the S3 path; a real bucket adds its own latency and throughput on top.
"""

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a clone without installing; bench/ itself is the script's folder


def convert(corpus: Path, out: str) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, str(ROOT / "convert/owt_to_mds.py"), "--dataset", str(corpus), "--out", out,
                    "--no-progress", "--val-fraction", "0", "--shard-size", "8mb"], check=True,
                   stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def read(remote: str, local: Path | None, batches: int, block: int = 1024, batch: int = 16) -> tuple[float, float]:
    """Seconds to the first batch, and tokens/s over the following `batches` batches."""
    from tokstream.reader.config import DataConfig
    from tokstream.reader.batches import make_loader

    config = DataConfig(remote=remote, local=str(local) if local else None)  # defaults, as training uses
    started = time.perf_counter()
    loader = make_loader(config, "train", batch, shuffle=True, pin_memory=False)
    iterator = iter(loader)
    next(iterator)
    first = time.perf_counter() - started
    started = time.perf_counter()
    count = 0
    for _ in range(batches):
        try:
            next(iterator)
        except StopIteration:
            break
        count += 1
    return first, count * batch * block / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=40)
    parser.add_argument("--batches", type=int, default=300)
    args = parser.parse_args()

    from convert_speed import build_corpus
    from tokstream.testing.loopback_s3 import start_loopback_s3

    start_loopback_s3("bench")
    # Download-ahead threads may still be filling a cache when the directory is removed.
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        tmp = Path(tmp)
        corpus = tmp / "corpus.jsonl"
        build_corpus(corpus, args.mb)
        local_s = convert(corpus, str(tmp / "local"))
        s3_s = convert(corpus, "s3://bench/ds")
        print(f"conversion of {args.mb} MB of text: local {local_s:.2f} s, s3 {s3_s:.2f} s, "
              f"ratio_s3_vs_local={local_s / s3_s:.2f}")

        local_first, local_rate = read(str(tmp / "local"), None, args.batches)
        cold_first, cold_rate = read("s3://bench/ds", tmp / "cache", args.batches)
        warm_first, warm_rate = read("s3://bench/ds", tmp / "cache", args.batches)
        shutil.rmtree(tmp / "cache", ignore_errors=True)
    print(f"{'training reads':22s} {'first batch':>12s} {'steady tok/s':>14s}")
    for name, first, rate in (("local dataset", local_first, local_rate), ("s3, cold cache", cold_first, cold_rate),
                              ("s3, warm cache", warm_first, warm_rate)):
        print(f"{name:22s} {first * 1e3:9.0f} ms {rate / 1e6:11.2f} M")
    print(f"ratio_cold_vs_local={cold_rate / local_rate:.2f} ratio_warm_vs_local={warm_rate / local_rate:.2f}")
    # The server (a daemon thread) stays up until the process ends: the readers' download-ahead
    # threads may still be fetching past the measured batches.


if __name__ == "__main__":
    from tokstream.testing.lock_files import removing_new_lock_files

    with removing_new_lock_files():
        main()
