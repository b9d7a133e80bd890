"""Datasets of any size that take no disk: a real dataset's metadata.json and index.json, its one shard repeated under
new names with the sample counts asked for, each file sparse (the right size, the right sample count in its first 4
bytes, nothing else written). The order and the ledger read only the index: tests of the order at 10^9 to 10^11
samples open these as any dataset (tests/test_order_at_scale.py). Reading a sample of one reads zeros."""

import json
from pathlib import Path

import numpy as np


def index_only(template: Path, root: Path, shard_samples: list[int]) -> Path:
    """A copy of `template` (a converted dataset of one train shard, uncompressed) whose train split holds shards of
    these sample counts."""
    index = json.loads((template / "train" / "index.json").read_text())
    shard = index["shards"][0]
    sample_bytes = shard["column_sizes"][0]
    header = shard["raw_data"]["bytes"] - 4 * (shard["samples"] + 2) - shard["samples"] * sample_bytes  # MDS's JSON
    (root / "train").mkdir(parents=True)
    shards = []
    for number, samples in enumerate(shard_samples):
        name = f"shard.{number:05d}.mds"
        size = 4 * (samples + 2) + header + samples * sample_bytes  # the count, samples + 1 offsets, the samples
        with open(root / "train" / name, "wb") as out:
            out.write(np.uint32(samples).tobytes())
            out.truncate(size)
        shards.append({**shard, "samples": samples, "raw_data": {**shard["raw_data"], "basename": name, "bytes": size}})
    (root / "train" / "index.json").write_text(json.dumps({**index, "shards": shards}))
    metadata = json.loads((template / "metadata.json").read_text())
    train = metadata["splits"]["train"]
    tokens = int(sum(shard_samples)) * (metadata["block_size"])
    metadata["splits"] = {"train": {**train, "samples": int(sum(shard_samples)), "tokens": tokens}}
    (root / "metadata.json").write_text(json.dumps(metadata))
    return root
