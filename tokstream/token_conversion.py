"""Token streams already on disk to a block-aligned MDS split: the core of bin_to_mds.py.

The files are concatenated in the order given; the output stream equals the input stream, cut
into samples exactly as text conversion cuts it. Memory stays at one chunk plus one shard.
"""

import mmap
import os
from pathlib import Path

import numpy as np
from tqdm import tqdm

from tokstream.errors import UserError
from tokstream.format import (METADATA_FILE, BlockPacker, DatasetMetadata, ShardWriter, SplitStats,
                              read_metadata, token_dtype, write_metadata)
from tokstream.object_store import is_s3
from tokstream.staging import staged_output
from tokstream.token_files import TokenFile, check_chunk

CHUNK_TOKENS = 1 << 24  # 32 MB of uint16 per read


def _release_pages(tokens: np.ndarray) -> None:
    """Drop the mapped pages already read from this process's RSS (they stay in the page cache)."""
    mapping = getattr(tokens, "_mmap", None)  # numpy.memmap keeps its mmap.mmap here
    if mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
        mapping.madvise(mmap.MADV_DONTNEED)


def pack_token_files(files: list[TokenFile], directory: Path, metadata: DatasetMetadata, shard_size: str,
                     compression: str | None, hashes: list[str], progress: bool, on_file=None) -> SplitStats:
    """Write one split from the files' concatenated tokens into `directory`."""
    packer = BlockPacker(metadata.block_size, metadata.np_dtype)
    writer = ShardWriter(directory, metadata, shard_size, compression, hashes, on_file=on_file)
    stats = SplitStats()
    total = sum(len(f.tokens) for f in files)
    with tqdm(total=total, unit="tok", unit_scale=True, desc="packing", disable=not progress, delay=2) as bar:
        for token_file in files:
            for start in range(0, len(token_file.tokens), CHUNK_TOKENS):
                chunk = np.asarray(token_file.tokens[start : start + CHUNK_TOKENS])
                check_chunk(chunk, metadata.vocab_size, token_file, start)
                stats.documents += int(np.count_nonzero(chunk == metadata.eot_id))
                writer.write(packer.add(chunk))
                bar.update(len(chunk))
                _release_pages(token_file.tokens)
    if packer.samples == 0:
        raise UserError(f"{packer.tokens} tokens in all inputs: fewer than one sample of block_size + 1 = "
                        f"{metadata.block_size + 1}")
    writer.finish()
    stats.tokens, stats.samples, stats.dropped_tokens = packer.tokens, packer.samples, packer.dropped_tokens
    stats.shards = len(writer.shards)
    stats.bytes = sum((shard["zip_data"] or shard["raw_data"])["bytes"] for shard in writer.shards)
    return stats


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
    if not is_s3(out) and (root / METADATA_FILE).is_file() and not overwrite:
        return _add_local_splits(files_by_split, root, metadata, shard_size, compression, hashes, progress)
    with staged_output(out, overwrite, staging_dir) as staging:
        for split, files in files_by_split.items():
            metadata.splits[split] = pack_token_files(files, staging.path / split, metadata, shard_size, compression,
                                                      list(hashes), progress, staging.on_file)
        write_metadata(staging.path, metadata)
    return metadata


def _add_local_splits(files_by_split: dict[str, list[TokenFile]], root: Path, metadata: DatasetMetadata,
                      shard_size: str, compression: str | None, hashes: tuple[str, ...],
                      progress: bool) -> DatasetMetadata:
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
        with staged_output(root / split, False) as staging:
            existing.splits[split] = pack_token_files(files, staging.path, existing, shard_size, compression,
                                                      list(hashes), progress)
    temporary = root / (METADATA_FILE + ".tmp")
    temporary.write_text(existing.to_json())
    os.replace(temporary, root / METADATA_FILE)  # the new split is visible to training only from here
    return existing
