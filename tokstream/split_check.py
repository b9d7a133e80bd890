"""A converted split checked against its metadata and its files before anything reads it: the reader
(tokstream.reader) and the Grain source (grain_source.py) refuse the same damage in the same words, and
know a split by the same identity. Needs neither streaming nor torch."""

import hashlib
import json
from pathlib import Path

from tokstream.errors import UserError
from tokstream.format import METADATA_FILE, DatasetMetadata, shard_sample_count, stored_file


def damaged_shard(path: object, problem: str, dataset: str) -> str:
    """The one line for a shard that is not what its dataset's index and metadata say."""
    return (f"shard {path} {problem}: the dataset is damaged; python convert/verify.py {dataset} checks every shard, "
            "reconverting repairs it")


def sample_count_problem(held: int, indexed: int) -> str | None:
    """A shard must hold the samples its index entry counts: streaming reads up to that count."""
    return None if held == indexed else f"holds {held} samples, the index says {indexed}"


def check_split(root: Path, split: str, metadata: DatasetMetadata, dataset: str, local_files: bool) -> None:
    """A split's index.json against the metadata's count and, with `local_files` (a local dataset), every
    shard it names against the file: its size (hashes are convert/verify.py's job) and, uncompressed, the
    sample count in its header (4 bytes read; a compressed shard's is checked when the reader maps it).
    A stale count is named here, not found as epochs of repeats or an IndexError deep in a reader."""
    index = root / split / "index.json"
    if not index.is_file():
        raise UserError(f"{index} is missing: the {split} split's conversion never finished; reconvert it")
    try:
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
    for basename, expected, uncompressed, samples in files:
        path = root / split / basename
        size = path.stat().st_size if path.is_file() else None
        if size != expected:
            raise UserError(damaged_shard(path, "is missing" if size is None else
                                          f"has {size} bytes, the index says {expected}", dataset))
        if uncompressed and (problem := sample_count_problem(shard_sample_count(path), samples)):
            raise UserError(damaged_shard(path, problem, dataset))


def dataset_identity(root: Path, split: str) -> str:
    """Digest of the metadata and the split's index: a resumed run must see the very same samples."""
    digest = hashlib.sha256(Path(root, METADATA_FILE).read_bytes())
    digest.update(Path(root, split, "index.json").read_bytes())
    return digest.hexdigest()[:16]
