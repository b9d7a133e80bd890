"""Token streams already on disk to a block-aligned MDS split: the core of bin_to_mds.py.

The files are concatenated in the order given; the output stream equals the input stream, cut
into samples exactly as text conversion cuts it. Memory stays at one chunk plus one shard.
"""

import dataclasses
import json
import mmap
import os
from pathlib import Path

import numpy as np
from tqdm import tqdm

from tokstream.errors import UserError
from tokstream.format import (METADATA_FILE, BlockPacker, DatasetMetadata, ShardWriter, SplitStats,
                              read_journal, read_metadata, token_dtype, write_metadata)
from tokstream.object_store import is_s3
from tokstream.staging import file_stamp, staged_output
from tokstream.token_files import TokenFile, check_chunk

CHUNK_TOKENS = 1 << 24  # 32 MB of uint16 per read
SPLIT_STATS_FILE = ".split-stats.json"  # a finished split's counts, kept only while the run is unfinished


def _release_pages(tokens: np.ndarray) -> None:
    """Drop the mapped pages already read from this process's RSS (they stay in the page cache)."""
    mapping = getattr(tokens, "_mmap", None)  # numpy.memmap keeps its mmap.mmap here
    if mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
        mapping.madvise(mmap.MADV_DONTNEED)


def pack_token_files(files: list[TokenFile], directory: Path, metadata: DatasetMetadata, shard_size: str,
                     compression: str | None, hashes: list[str], progress: bool, on_file=None,
                     resumable: bool = False) -> SplitStats:
    """Write one split from the files' concatenated tokens into `directory`.

    Resumable (local outputs): completed shards are journaled, and a rerun after a kill verifies
    them and continues from the first sample they do not hold. A finished split is not redone.
    """
    stats_file = directory / SPLIT_STATS_FILE
    if resumable and stats_file.is_file() and (directory / "index.json").is_file():
        return SplitStats(**json.loads(stats_file.read_text()))
    done = read_journal(directory) if resumable else []
    skip = sum(shard["samples"] for shard in done) * metadata.block_size  # first token of the next sample
    packer = BlockPacker(metadata.block_size, metadata.np_dtype)
    packer.tokens, packer.samples = skip, skip // metadata.block_size
    writer = ShardWriter(directory, metadata, shard_size, compression, hashes, on_file=on_file,
                         resume_shards=done, journal=resumable)
    documents = 0
    total = sum(len(f.tokens) for f in files)
    if done:
        print(f"resuming {directory.name}: {len(done)} shards verified, continuing at token {skip:,}")
    with tqdm(total=total, unit="tok", unit_scale=True, desc="packing", disable=not progress, delay=2) as bar:
        offset = 0  # of the current file in the concatenated stream
        for token_file in files:
            for start in range(0, len(token_file.tokens), CHUNK_TOKENS):
                chunk = np.asarray(token_file.tokens[start : start + CHUNK_TOKENS])
                check_chunk(chunk, metadata.vocab_size, token_file, start)
                documents += int(np.count_nonzero(chunk == metadata.eot_id))
                first_new = max(0, skip - (offset + start))  # tokens already in verified shards
                if first_new < len(chunk):
                    writer.write(packer.add(chunk[first_new:]))
                bar.update(len(chunk))
                _release_pages(token_file.tokens)
            offset += len(token_file.tokens)
    if packer.samples == 0:
        raise UserError(f"{packer.tokens} tokens in all inputs: fewer than one sample of block_size + 1 = "
                        f"{metadata.block_size + 1}")
    writer.finish()
    stats = writer.split_stats(packer, documents)
    if resumable:
        stats_file.write_text(json.dumps(dataclasses.asdict(stats)))
    return stats


def resume_key(files_by_split: dict[str, list[TokenFile]], settings: dict) -> dict:
    """What must match for an interrupted conversion to be continued rather than redone."""
    inputs = {split: [[str(f.path), *file_stamp(f.path), f.format] for f in files]
              for split, files in files_by_split.items()}
    return {"inputs": inputs, **settings}


def convert_token_files(files_by_split: dict[str, list[TokenFile]], out: str, block_size: int,
                        tokenizer_name: str, vocab_size: int, eot_id: int, shard_size: str = "64mb",
                        compression: str | None = None, hashes: tuple[str, ...] = ("xxh64",),
                        overwrite: bool = False, progress: bool = True,
                        staging_dir: str | None = None) -> DatasetMetadata:
    """Write dataset `out` with these splits; into an existing local dataset, add (or replace) them.

    E.g. train.bin and val.bin in one call, or train now and val later into the same local root.
    """
    if block_size < 1:
        raise UserError(f"--block-size must be at least 1, got {block_size}")
    if not all(files_by_split.values()):
        raise UserError("no input files")
    metadata = DatasetMetadata(
        tokenizer=tokenizer_name, vocab_size=vocab_size, eot_id=eot_id, block_size=block_size,
        dtype=token_dtype(vocab_size).name,
        source={"kind": "token-files", "splits": {
            split: {"files": [str(f.path) for f in files], "formats": [f.format for f in files]}
            for split, files in files_by_split.items()}},
        split={"method": "given", "note": "splits named on the command line; documents counted as eot tokens"},
    )
    root = Path(out)
    settings = {"block_size": block_size, "vocab_size": vocab_size, "shard_size": str(shard_size),
                "compression": compression, "hashes": sorted(hashes)}
    if not is_s3(out) and (root / METADATA_FILE).is_file() and not overwrite:
        return _add_local_splits(files_by_split, root, metadata, settings, progress)
    key = None if is_s3(out) else resume_key(files_by_split, settings)
    with staged_output(out, overwrite, staging_dir, resume_key=key) as staging:
        for split, files in files_by_split.items():
            metadata.splits[split] = pack_token_files(files, staging.path / split, metadata, shard_size, compression,
                                                      list(hashes), progress, staging.on_file, resumable=key is not None)
            (staging.path / split / SPLIT_STATS_FILE).unlink(missing_ok=True)
        write_metadata(staging.path, metadata)
    return metadata


def _add_local_splits(files_by_split: dict[str, list[TokenFile]], root: Path, metadata: DatasetMetadata,
                      settings: dict, progress: bool) -> DatasetMetadata:
    existing = read_metadata(root)
    for key in ("tokenizer", "vocab_size", "block_size", "dtype"):
        if getattr(existing, key) != getattr(metadata, key):
            raise UserError(f"{root} holds {key}={getattr(existing, key)!r}, this conversion "
                            f"{getattr(metadata, key)!r}: use another --out")
    if existing.source.get("kind") != "token-files":
        raise UserError(f"{root} was converted from {existing.source.get('kind')}, not token files: "
                        "use another --out")
    for split in files_by_split:
        if split in existing.splits:
            raise UserError(f"{root} already has a {split} split: pass --overwrite to rewrite the whole dataset")
    existing.source["splits"].update(metadata.source["splits"])
    for split, files in files_by_split.items():
        key = resume_key({split: files}, settings)
        with staged_output(root / split, False, resume_key=key) as staging:
            existing.splits[split] = pack_token_files(files, staging.path, existing, settings["shard_size"],
                                                      settings["compression"], settings["hashes"], progress,
                                                      resumable=True)
            (staging.path / SPLIT_STATS_FILE).unlink(missing_ok=True)
    temporary = root / (METADATA_FILE + ".tmp")
    temporary.write_text(existing.to_json())
    os.replace(temporary, root / METADATA_FILE)  # the new split is visible to training only from here
    return existing
