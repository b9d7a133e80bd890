"""How well the lazy order mixes, beside streaming's py1e (the order a user of stock streaming reads in), with the
same seed, block and canonical nodes, at blocks below, at and above the shard size, and on an OpenWebText-like
layout (shards of 16,384 samples of 1,024 tokens, block 4,096). feistel_window, the first lazy order, is shown too.

    python bench/shuffle_quality.py            # the table of bench/README.md
    python bench/shuffle_quality.py --epochs 3

Per order, averaged over epochs (one rank, so positions are the reading order):
- shards/batch: distinct shards in a global batch of 512 (more: each batch mixes more of the corpus);
- |step|: mean |id_i - id_(i+1)| of consecutive samples, over its value for a random order (1: as random);
- epoch rho: Spearman rho between a sample's positions in consecutive epochs (0: no memory of the last epoch);
- in-shard rho: mean over shards of the Spearman rho between the order a shard's samples are read in and their
  place in the shard (0: shuffled inside; 1: read front to back).
"""

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tokstream.reader.order import whole_epoch  # noqa: E402

BATCH = 512
LAYOUTS = [("207 x 97", 207, 97, 64), ("207 x 97", 207, 97, 97), ("207 x 97", 207, 97, 256),
           ("207 x 97", 207, 97, 2048), ("OWT-like 64 x 16,384", 64, 16_384, 4_096),
           ("OWT-like 64 x 16,384", 64, 16_384, 65_536)]


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def in_shard_rho(ids: np.ndarray, shard_size: int) -> float:
    shard = ids // shard_size
    order = np.argsort(shard, kind="stable")  # each shard's samples in reading order
    within = (ids % shard_size)[order]
    bounds = np.flatnonzero(np.diff(shard[order])) + 1
    rhos = [spearman(np.arange(len(part)), part) for part in np.split(within, bounds) if len(part) > 2]
    return float(np.mean(rhos))


def quality(orders: list[np.ndarray], shard_size: int) -> dict[str, float]:
    n = len(orders[0])
    random_step = (n * n - 1) / (3 * n)  # E|X - Y| for X, Y uniform on 0..n-1
    rows = []
    for e, ids in enumerate(orders):
        batches = ids[:n - n % BATCH].reshape(-1, BATCH) // shard_size
        shards = np.mean([len(np.unique(batch)) for batch in batches])
        step = np.abs(np.diff(ids)).mean() / random_step
        shard = in_shard_rho(ids, shard_size)
        epoch = spearman(np.argsort(orders[e - 1]), np.argsort(ids)) if e else np.nan  # positions by sample id
        rows.append((shards, step, epoch, shard))
    rows = np.array(rows)
    return {"shards/batch": rows[:, 0].mean(), "|step|": rows[:, 1].mean(), "epoch rho": np.nanmean(rows[:, 2]),
            "in-shard rho": rows[:, 3].mean()}


def measure(shards: int, shard_size: int, block: int, epochs: int, nodes: int, seed: int) -> dict[str, dict]:
    from tokstream.reader.streaming_door.streaming_internals import get_shuffle  # stock streaming's own

    sizes = np.full(shards, shard_size, np.int64)
    out = {"py1e": quality([get_shuffle("py1e", sizes, nodes, seed, e, block) for e in range(epochs)], shard_size)}
    for name in ("lazy", "feistel_window"):
        out[name] = quality([whole_epoch(name)(sizes, nodes, seed, e, block) for e in range(epochs)], shard_size)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=2, help="canonical nodes (the same for every order)")
    parser.add_argument("--seed", type=int, default=9176)
    args = parser.parse_args()
    print(f"| layout | block | order | shards/batch | abs(step) vs random | epoch rho | in-shard rho |")
    print("|---|---|---|---|---|---|---|")
    for label, shards, shard_size, block in LAYOUTS:
        for name, q in measure(shards, shard_size, block, args.epochs, args.nodes, args.seed).items():
            print(f"| {label} | {block:,} | {name} | {q['shards/batch']:.2f} | {q['|step|']:.3f} | "
                  f"{q['epoch rho']:.3f} | {q['in-shard rho']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
