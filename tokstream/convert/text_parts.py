"""Text conversion split into parts, for several machines or for resuming, then merged into one dataset.

Tokenizing is the expensive step, so that is what the parts share. Part I of N takes a contiguous
range of the input files (balanced by bytes) and writes, per split, its token stream and one
(fingerprint, token count) record per document into `OUT.parts/part-0000I-of-0000N/`, under a
temporary name renamed when complete. The merge reads the parts in order, drops documents already
seen in an earlier part when dedup is on, and packs the concatenated stream exactly as a one-process
conversion would: the merged dataset is byte-identical to a single-part run (tested). Packing is
I/O-bound (see bench/bin_speed.py), so it runs on one machine over the shared filesystem.

A part that was killed is redone from its start on the next run; complete parts are kept.
"""

import dataclasses
import json
import os
import shutil
from pathlib import Path

import numpy as np

from tokstream.convert.cleaning import Cleaning, FingerprintSet
from tokstream.convert.dataset_writer import SplitWriter, finish_dataset, text_metadata
from tokstream.convert.options import ConversionOptions
from tokstream.convert.output_guard import conversion_lock, local_stand_in
from tokstream.convert.resume import PART_DONE_FILE
from tokstream.convert.sources import DocumentSource
from tokstream.convert.staging import staged_output
from tokstream.convert.tokenize_docs import Counters, tokenized_batches
from tokstream.errors import UserError
from tokstream.format import DatasetMetadata, token_dtype
from tokstream.tokenizer import Tokenizer

DOC_RECORD = np.dtype([("fingerprint", "<u8"), ("tokens", "<i8")])
CHUNK_TOKENS = 1 << 24


def parts_root(out: str | os.PathLike, staging_dir: str | None = None) -> Path:
    """OUT.parts beside a local output; for an S3 output, under --staging (shared by the machines)."""
    stand_in = local_stand_in(out, staging_dir)
    return stand_in.with_name(stand_in.name + ".parts")


def part_dir(out: str | os.PathLike, part: int, num_parts: int, staging_dir: str | None = None) -> Path:
    return parts_root(out, staging_dir) / f"part-{part:05d}-of-{num_parts:05d}"


def resolve_part(part: str | None, num_parts: int) -> int | None:
    """`--part auto` reads the launcher's rank (torchrun RANK or Slurm SLURM_PROCID)."""
    if part is None:
        return None
    if part == "auto":
        rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID"))
        world = os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS"))
        if rank is None or world is None:
            raise UserError("--part auto needs RANK/WORLD_SIZE (torchrun) or SLURM_PROCID/SLURM_NTASKS")
        if int(world) != num_parts:
            raise UserError(f"--num-parts {num_parts} but the launcher runs {world} tasks")
        part = rank
    index = int(part)
    if not 0 <= index < num_parts:
        raise UserError(f"--part must be in [0, {num_parts}), got {index}")
    return index


def assign_files(files: list[str], num_parts: int) -> list[list[str]]:
    """Contiguous runs of files, cut where the running byte total crosses k/N of the whole."""
    if num_parts < 1:
        raise UserError(f"--num-parts must be at least 1, got {num_parts}")
    if num_parts > len(files):
        raise UserError(f"--num-parts {num_parts} exceeds the {len(files)} input files; parts are whole files")
    sizes = np.cumsum([max(1, os.path.getsize(f)) for f in files])
    bounds = [0]
    for k in range(1, num_parts):
        cut = int(np.searchsorted(sizes, sizes[-1] * k / num_parts)) + 1
        cut = max(cut, bounds[-1] + 1)  # at least one file in the part before
        cut = min(cut, len(files) - (num_parts - k))  # and one left for each part after
        bounds.append(cut)
    bounds.append(len(files))
    return [files[bounds[i] : bounds[i + 1]] for i in range(num_parts)]


def convert_part(source: DocumentSource, part: int, num_parts: int, out: str, tokenizer: Tokenizer,
                 options: ConversionOptions, cleaning: Cleaning) -> bool:
    """Tokenize one part's documents; return False if that part was already complete."""
    directory = part_dir(out, part, num_parts, options.staging_dir)
    # Machines converting other parts run beside this one: the lock is this part's, not the output's.
    with conversion_lock(directory):
        if (directory / PART_DONE_FILE).is_file():
            return False
        _write_part(source, directory, tokenizer, options, cleaning)
    return True


def _write_part(source: DocumentSource, directory: Path, tokenizer: Tokenizer, options: ConversionOptions,
                cleaning: Cleaning) -> None:
    counters = Counters()
    no_dedup = dataclasses.replace(cleaning, dedup_memory=None)  # dedup happens at the merge, over all parts
    names = options.text_splits
    with staged_output(directory, overwrite=True) as staging:
        tokens = {name: open(staging.path / f"{name}.tokens", "wb") for name in names}
        records = {name: open(staging.path / f"{name}.docs", "wb") for name in names}
        for batch in tokenized_batches(source, tokenizer, options, no_dedup, counters,
                                       token_dtype(tokenizer.vocab_size), fingerprints=True):
            for name, ids, lengths, prints in (("train", batch.train, batch.train_lengths, batch.train_prints),
                                               ("val", batch.val, batch.val_lengths, batch.val_prints)):
                if len(lengths):
                    # write(), not ndarray.tofile: its short write raises an OSError without the errno
                    # that says the disk is full
                    tokens[name].write(ids.tobytes())
                    record = np.empty(len(lengths), DOC_RECORD)
                    record["fingerprint"], record["tokens"] = prints, lengths
                    records[name].write(record.tobytes())
        for handle in [*tokens.values(), *records.values()]:
            handle.close()
        report = {"invalid_utf8_documents_replaced": counters.read.invalid_utf8_docs,
                  "empty": counters.cleaning.empty}
        (staging.path / PART_DONE_FILE).write_text(json.dumps(report, sort_keys=True))


def merge_parts(out: str, num_parts: int, description: dict, tokenizer: Tokenizer, options: ConversionOptions,
                cleaning: Cleaning) -> DatasetMetadata:
    """Join complete parts into the dataset `out`; the parts folder is removed afterwards."""
    directories = [part_dir(out, i, num_parts, options.staging_dir) for i in range(num_parts)]
    missing = [str(i) for i, d in enumerate(directories) if not (d / PART_DONE_FILE).is_file()]
    if missing:
        raise UserError(f"parts {', '.join(missing)} of {num_parts} are not finished: run them "
                        f"(--part I --num-parts {num_parts}) before --merge")
    metadata = text_metadata(tokenizer, options, description)
    seen = FingerprintSet(cleaning.dedup_memory) if cleaning.dedup_memory else None
    duplicates = 0
    extra = {"invalid_utf8_documents_replaced": 0, "empty": 0, "duplicates": 0}
    for directory in directories:
        for key, value in json.loads((directory / PART_DONE_FILE).read_text()).items():
            extra[key] += value
    with staged_output(out, options.overwrite, options.staging_dir) as staging:
        outputs = {name: SplitWriter(name, staging.path / name, metadata, options, staging.on_file) for name in options.text_splits}
        # Split by content hash, so a repeat lands in its first occurrence's split: one set serves both.
        for directory in directories:
            for name, output in outputs.items():
                duplicates += _merge_split(directory, name, output, metadata, seen)
        extra["duplicates"] = duplicates
        finish_dataset(staging, metadata, outputs, extra)
    _remove_parts(directories, parts_root(out, options.staging_dir))
    return metadata


def _remove_parts(directories: list[Path], root: Path) -> None:
    """Remove the merged parts (each finished, with its part.json), then their folder if nothing else is there."""
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)
    try:
        root.rmdir()
    except OSError:
        pass  # it holds what this merge did not make (parts of another --num-parts): that stays


def _merge_split(directory: Path, name: str, output: SplitWriter, metadata: DatasetMetadata,
                 seen: FingerprintSet | None) -> int:
    """Append one part's split to the output; return how many documents were dropped as repeats."""
    records = np.fromfile(directory / f"{name}.docs", dtype=DOC_RECORD)
    if not len(records):
        return 0
    tokens = np.memmap(directory / f"{name}.tokens", dtype=metadata.np_dtype, mode="r")
    keep = np.ones(len(records), dtype=bool)
    if seen is not None:
        keep = np.fromiter((seen.add(int(p)) for p in records["fingerprint"]), dtype=bool, count=len(records))
    ends = np.cumsum(records["tokens"])
    starts = ends - records["tokens"]
    # Feed contiguous runs of kept documents, in chunks, so memory stays at one chunk.
    edges = np.flatnonzero(np.diff(np.concatenate([[False], keep, [False]]).astype(np.int8)))
    for first, last in zip(edges[::2], edges[1::2]):
        run_start, run_end = int(starts[first]), int(ends[last - 1])
        for chunk_start in range(run_start, run_end, CHUNK_TOKENS):
            chunk_end = min(run_end, chunk_start + CHUNK_TOKENS)
            documents = int(last - first) if chunk_end == run_end else 0  # the run's, with its last chunk
            output.add(np.asarray(tokens[chunk_start:chunk_end]), documents)
    return int(len(records) - keep.sum())
