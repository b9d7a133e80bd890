"""A one-pass conversion's state, saved between batches so that a killed run continues from there.

The state records the next input document and, for each split, its finished shards, the samples
still in the writer's buffer, the tokens still in the packer, and its counts. A resumed run reads
the input again from the start, so cleaning, dedup and the source's counters see every document
again. It tokenizes only from the next document on and writes the bytes an uninterrupted run
writes (tested).
"""

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np


STATE_FILE = ".conversion-state.npz"


@dataclass
class SplitState:
    shards: list[dict]  # index.json entries of the finished shards
    documents: int
    tokens: int
    samples: int
    buffered: np.ndarray  # (count, block_size + 1) samples not yet in a shard
    pending: np.ndarray  # tokens the packer holds towards the next sample


def save_state(directory: Path, next_document: int, splits: dict[str, SplitState]) -> None:
    """Replace the saved state atomically: a kill during the write leaves the previous one."""
    header = {"next_document": next_document,
              "splits": {name: {"shards": s.shards, "documents": s.documents, "tokens": s.tokens,
                                "samples": s.samples} for name, s in splits.items()}}
    arrays = {"header": np.frombuffer(json.dumps(header).encode("utf-8"), dtype=np.uint8)}
    for name, split in splits.items():
        arrays[f"{name}.buffered"] = split.buffered
        arrays[f"{name}.pending"] = split.pending
    temporary = directory / (STATE_FILE + ".tmp")
    with open(temporary, "wb") as out:
        np.savez(out, **arrays)
    os.replace(temporary, directory / STATE_FILE)


def load_state(directory: Path,
               shard_intact: Callable[[str, dict], bool]) -> tuple[int, dict[str, SplitState]] | None:
    """The saved state, if there is one and `shard_intact(split, shard)` holds for every shard it names."""
    path = directory / STATE_FILE
    if not path.is_file():
        return None
    with np.load(path) as saved:
        header = json.loads(saved["header"].tobytes())
        splits = {name: SplitState(buffered=saved[f"{name}.buffered"], pending=saved[f"{name}.pending"], **counts)
                  for name, counts in header["splits"].items()}
    for name, split in splits.items():
        if not all(shard_intact(name, shard) for shard in split.shards):
            return None
    return header["next_document"], splits


def discard_state(directory: Path) -> None:
    """Remove the state (and a torn write of it): a finished dataset carries none."""
    for name in (STATE_FILE, STATE_FILE + ".tmp"):
        (directory / name).unlink(missing_ok=True)
