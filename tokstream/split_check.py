"""Shared by the reader and the Grain source: a converted split checked against its metadata and its files before
anything reads it. Both refuse the same damage in the same words and know a split by the same identity. Needs
neither streaming nor torch."""

import hashlib
import json
import os
import stat
from pathlib import Path

import numpy as np

from tokstream.errors import UserError
from tokstream.gc_pause import collector_paused
from tokstream.format import METADATA_FILE, DatasetMetadata, shard_sample_count, stored_file


def damaged_shard(path: object, problem: str, dataset: str) -> str:
    """The one line for a shard that is not what its dataset's index and metadata say."""
    return (f"shard {path} {problem}: the dataset is damaged; python convert/verify.py {dataset} checks every shard, "
            "reconverting repairs it")


def sample_count_problem(held: int, indexed: int) -> str | None:
    """A shard must hold the samples its index entry counts: streaming reads up to that count."""
    return None if held == indexed else f"holds {held} samples, the index says {indexed}"


# Read in pieces of this size by largest_token: a whole shard's pages would otherwise be mapped in.
CHECK_CHUNK = 4 << 20


def largest_token(path: object, begin: int, end: int, dtype: np.dtype) -> int:
    """The largest token id in bytes [begin, end) of a shard file (0 if none), read through a buffer in pieces
    rather than through the mapping: a whole-shard pass through the mapping would make every page of the shard
    resident in the process, where training touches only its samples' pages. The Grain source's check, when it
    maps a shard (the project's reader checks the rows it reads instead)."""
    largest, itemsize = 0, np.dtype(dtype).itemsize
    buffer = bytearray(CHECK_CHUNK)
    with open(path, "rb", buffering=0) as file:
        file.seek(begin)
        while begin < end:
            read = file.readinto(memoryview(buffer)[:min(CHECK_CHUNK, end - begin)])
            if not read:
                break  # shorter than its offsets say: shard_samples has refused that already
            tokens = read // itemsize
            if tokens:
                largest = max(largest, int(np.frombuffer(buffer, dtype, count=tokens).max()))
            begin += read
    return largest


def vocabulary_problem(largest: int, vocab_size: int) -> str | None:
    """A shard whose `largest` token id is past its dataset's vocabulary would end training in an embedding
    lookup (a device assert on a GPU): the words for it, or None."""
    if largest >= vocab_size:
        return f"holds token id {largest}, outside the dataset's vocab_size {vocab_size}"
    return None


def check_split(root: Path, split: str, metadata: DatasetMetadata, dataset: str, local_files: bool) -> None:
    """A split's index.json against the metadata's count and, with `local_files` (a local dataset), every
    shard it names against the file: its size (hashes are convert/verify.py's job) and, uncompressed, the
    sample count in its header (4 bytes read; a compressed shard's is checked when the reader maps it).
    A stale count is named here, not found as epochs of repeats or an IndexError deep in a reader."""
    index = root / split / "index.json"
    if not index.is_file():
        raise UserError(f"{index} is missing: the {split} split's conversion never finished; reconvert it")
    try:
        with collector_paused():  # objects per shard: tens of thousands (gc_pause.py)
            shards = json.loads(index.read_text())["shards"]
            indexed = sum(shard["samples"] for shard in shards)
            files = [(stored_file(shard)["basename"], stored_file(shard)["bytes"], shard["zip_data"] is None,
                      shard["samples"]) for shard in shards]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise UserError(f"{index} is damaged ({type(err).__name__}: {err}); reconvert the split") from None
    if metadata.splits[split].samples != indexed:
        raise UserError(f"{dataset}/{METADATA_FILE} says the {split} split has {metadata.splits[split].samples} "
                        f"samples, its index.json {indexed}: one of them is stale or hand-edited; python "
                        f"convert/verify.py {dataset} checks the dataset, reconverting repairs it")
    if not local_files:  # remote shards are checked against their hashes as they arrive, and when mapped
        return
    folder = os.path.join(root, split)  # plain strings and os calls: this runs once per shard, at every start
    for basename, expected, uncompressed, samples in files:
        path = os.path.join(folder, basename)
        try:
            found = os.stat(path)
            size = found.st_size if stat.S_ISREG(found.st_mode) else None
            if size != expected:
                raise UserError(damaged_shard(Path(path), "is missing" if size is None else
                                              f"has {size} bytes, the index says {expected}", dataset))
            if uncompressed and (problem := sample_count_problem(shard_sample_count(path), samples)):
                raise UserError(damaged_shard(Path(path), problem, dataset))
        except FileNotFoundError:
            raise UserError(damaged_shard(Path(path), "is missing", dataset)) from None
        except OSError as err:  # a loop of links, a name too long, no permission
            raise UserError(damaged_shard(Path(path), f"cannot be read ({err.strerror or err})", dataset)) from None


def dataset_identity(root: Path, split: str) -> str:
    """Digest of what decides the split's samples, for a resumed run to see the very same ones: the metadata as it
    concerns this split (the other splits' entries left out, so that a split added beside it changes nothing) and
    the split's index."""
    metadata = json.loads(Path(root, METADATA_FILE).read_bytes())
    for holder in (metadata, metadata.get("source")):
        if isinstance(holder, dict) and isinstance(holder.get("splits"), dict):
            holder["splits"] = {name: entry for name, entry in holder["splits"].items() if name == split}
    digest = hashlib.sha256(json.dumps(metadata, sort_keys=True).encode())
    digest.update(Path(root, split, "index.json").read_bytes())
    return digest.hexdigest()[:16]


def former_dataset_identity(root: Path, split: str) -> str:
    """The identity runs recorded before 2026-11-28: metadata.json whole (a split added changed it) and the
    split's index. Still accepted on resume, so that runs started then go on."""
    digest = hashlib.sha256(Path(root, METADATA_FILE).read_bytes())
    digest.update(Path(root, split, "index.json").read_bytes())
    return digest.hexdigest()[:16]
