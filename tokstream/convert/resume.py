"""Everything a conversion leaves behind to be resumed, and the keys that decide whether it may be.

Markers, by where they live (all gone once the dataset is complete):

    OUT.partial/                     the dataset being built (local outputs); renamed to OUT at the end
    OUT.replaced/                    the previous OUT while an --overwrite swaps it out
    OUT.partial/.resume-key.json     what the interrupted run converted (RESUME_KEY_FILE); a rerun with
                                     another key is refused, or with --overwrite starts over
    OUT.partial/.conversion-state.npz  one-pass text: the next document and each split's shards,
                                     buffered samples and packer tokens (STATE_FILE, save_state)
    OUT.partial/SPLIT/.shards.journal  token files: each completed shard's index entry (JOURNAL_FILE)
    OUT.partial/SPLIT/.split-stats.json  token files: a finished split's counts (SPLIT_STATS_FILE)
    OUT.parts/part-I-of-N/part.json  text in parts: this part is complete (PART_DONE_FILE)

On S3 the key and the state are objects under the output prefix with the same names.
"""

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tokstream.format import SplitStats, shard_file_intact

RESUME_KEY_FILE = ".resume-key.json"
STATE_FILE = ".conversion-state.npz"
JOURNAL_FILE = ".shards.journal"
SPLIT_STATS_FILE = ".split-stats.json"
PART_DONE_FILE = "part.json"


def partial_path(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def replaced_path(out: Path) -> Path:
    return out.with_name(out.name + ".replaced")


# --- resume keys: what must match for an interrupted conversion to be continued, not redone ---------

def file_stamp(path: str | os.PathLike) -> list[int]:
    """Size and modification time of an input: a changed input is not resumed."""
    stat = os.stat(path)
    return [stat.st_size, stat.st_mtime_ns]


def text_resume_key(description: dict, tokenizer: list, settings: dict) -> dict:
    """A one-pass text conversion's key, in its JSON form (as compared with the stored copy)."""
    inputs = description
    if inputs.get("kind") == "local":
        inputs = {**inputs, "stat": [file_stamp(f) for f in inputs["files"]]}
    # The state's layout: 2 positions the source by chunk (a state of version 1 cannot be continued).
    return json.loads(json.dumps({"inputs": inputs, "tokenizer": tokenizer, "state_version": 2, **settings}))


def token_files_resume_key(inputs: dict[str, list[tuple[str, list, str]]], settings: dict) -> dict:
    """A token-file conversion's key: each split's (path, stamp, format) inputs."""
    stamped = {split: [[path, *stamp, fmt] for path, stamp, fmt in files] for split, files in inputs.items()}
    return json.loads(json.dumps({"inputs": stamped, **settings}))


def key_matches(key_file: Path, key: dict | None) -> bool:
    return key is not None and key_file.is_file() and json.loads(key_file.read_text()) == key


def write_key(key_file: Path, key: dict) -> None:
    key_file.write_text(json.dumps(key))


# --- one-pass text: the state saved between batches ---------------------------------------------------

@dataclass
class SplitState:
    """One split of a one-pass conversion where it stands (SplitWriter.state_dict)."""

    shards: list[dict]  # index.json entries of the finished shards
    documents: int
    tokens: int
    samples: int
    buffered: np.ndarray  # (count, block_size + 1) samples not yet in a shard
    pending: np.ndarray  # tokens the packer holds towards the next sample


def save_state(directory: Path, next_document: int, splits: dict[str, SplitState], source: dict | None = None) -> None:
    """Replace the saved state atomically: a kill during the write leaves the previous one.

    `source` (JSON) holds the source's position after document `next_document`, the number of
    chunks read to get there and the counters so far (text_one_pass.py).
    """
    header = {"next_document": next_document, "source": source,
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


def load_state(directory: Path, shard_intact: Callable[[str, dict], bool]
               ) -> tuple[int, dict[str, SplitState], dict | None] | None:
    """The saved state (next document, splits, source position), if there is one and
    `shard_intact(split, shard)` holds for every shard it names."""
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
    return header["next_document"], splits, header.get("source")


def discard_state(directory: Path) -> None:
    """Remove the state (and a torn write of it): a finished dataset carries none."""
    for name in (STATE_FILE, STATE_FILE + ".tmp"):
        (directory / name).unlink(missing_ok=True)


# --- token files: a journal of completed shards, and finished splits' counts ---------------------------

class ShardJournal:
    """Appends each shard a writer completes to SPLIT/.shards.journal, so a killed run continues there.

    No fsync: a resume re-checks every journaled shard's size and hashes (read_journal), so a shard
    the journal names but a crash did not fully persist is written again, not trusted.
    """

    def __init__(self, directory: Path):
        self.path = Path(directory) / JOURNAL_FILE

    def record(self, shard: dict) -> None:
        with open(self.path, "a") as journal:
            journal.write(json.dumps(shard, sort_keys=True) + "\n")

    def discard(self) -> None:
        self.path.unlink(missing_ok=True)


def read_journal(directory: str | os.PathLike) -> list[dict]:
    """The shards a killed writer completed, each checked against its recorded size and hashes.

    Reading stops at the first entry that is torn or whose file does not match: that shard and
    everything after it are written again.
    """
    path = Path(directory) / JOURNAL_FILE
    shards: list[dict] = []
    if not path.is_file():
        return shards
    for line in path.read_text().splitlines():
        try:
            shard = json.loads(line)
        except json.JSONDecodeError:
            break
        if not shard_file_intact(directory, shard):
            break
        shards.append(shard)
    path.write_text("".join(json.dumps(s, sort_keys=True) + "\n" for s in shards))  # drop the torn tail
    return shards


def save_split_stats(directory: Path, stats: SplitStats) -> None:
    (directory / SPLIT_STATS_FILE).write_text(json.dumps(asdict(stats)))


def finished_split_stats(directory: Path) -> SplitStats | None:
    """The counts of a split an interrupted run finished (index written), or None."""
    stats_file = directory / SPLIT_STATS_FILE
    if stats_file.is_file() and (directory / "index.json").is_file():
        return SplitStats(**json.loads(stats_file.read_text()))
    return None


def discard_split_stats(directory: Path) -> None:
    (directory / SPLIT_STATS_FILE).unlink(missing_ok=True)
