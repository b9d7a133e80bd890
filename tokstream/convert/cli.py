"""Command-line options shared by the converters, so every CLI stays a thin layer over the core."""

import argparse
import dataclasses
import gc
import os
import time
from contextlib import nullcontext
from pathlib import Path

from tokstream.convert.cleaning import Cleaning
from tokstream.convert.options import ConversionOptions
from tokstream.convert.output_guard import check_output_location, check_s3_output, conversion_lock
from tokstream.convert.text_conversion import convert_text
from tokstream.convert.token_conversion import Vocabulary
from tokstream.convert.token_files import LLMC_LLAMA3_MAGIC
from tokstream.errors import UserError
from tokstream.format import DatasetMetadata
from tokstream.format import parse_size
from tokstream.slurm import array_part
from tokstream.tokenizer import POSITIONS, load_tokenizer


def output_location(value: str) -> str:
    """--out as given, but a local path without a last name ('.', '..', 'data/.') made absolute: the
    output's partial and lock files are named after it. The root folder is refused."""
    if value.startswith("s3://") or Path(value).name:
        return value
    absolute = os.path.abspath(value)
    if not Path(absolute).name:
        raise argparse.ArgumentTypeError(f"{value} is the root folder: give the output folder's own path")
    return absolute


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of every converter: where and how samples are written."""
    parser.add_argument("--out", required=True, type=output_location,
                        help="output dataset root, a local path or s3://bucket/prefix (gets SPLIT/ and metadata.json)")
    parser.add_argument("--block-size", type=int, default=1024, help="tokens per block; samples hold block+1")
    parser.add_argument("--tokenizer", "--encoding", dest="tokenizer", default="gpt2",
                        help="a tiktoken encoding (default gpt2), a tokenizer.json, or a hub repository with one")
    parser.add_argument("--ranks-file", default=None, help="local GPT-2/r50k_base .tiktoken ranks file (offline)")
    parser.add_argument("--separator", default="auto",
                        help="document separator: after:TOKEN (end-of-text, GPT-2) or before:TOKEN (begin-of-text, "
                             "Llama-3); auto: <|endoftext|> after, else <|begin_of_text|> before")
    parser.add_argument("--shard-size", default="64mb", help="MDS shard size limit")
    parser.add_argument("--compression", default=None, help="MDS shard compression: zstd or zstd:LEVEL")
    parser.add_argument("--hashes", default="xxh64", help="comma-separated shard hashes ('' for none)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output")
    parser.add_argument("--staging", default=None,
                        help="local scratch for s3:// outputs (a few shards; parts of multi-machine runs)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_vocabulary_arguments(parser: argparse.ArgumentParser) -> None:
    """bin_to_mds.py's: ids described by their range and separator, for files whose tokenizer is known by name only."""
    parser.add_argument("--vocab-size", type=int, default=None, help="ids are below this (instead of --tokenizer)")
    parser.add_argument("--separator-id", type=int, default=None, help="the separator id (with --vocab-size)")
    parser.add_argument("--separator-position", choices=POSITIONS, default="after",
                        help="separator after each document (end-of-text, default) or before it (begin-of-text)")


def token_vocabulary(args: argparse.Namespace, files: list) -> Vocabulary:
    """What token files' ids mean: from --vocab-size/--separator-id when given, else from --tokenizer."""
    if args.vocab_size is not None or args.separator_id is not None:
        if args.vocab_size is None or args.separator_id is None:
            raise UserError("--vocab-size and --separator-id go together: give both")
        if args.tokenizer != "gpt2":
            raise UserError("--tokenizer and --vocab-size both describe the ids: give one")
        return Vocabulary(f"vocab-{args.vocab_size}", None, args.vocab_size, args.separator_id,
                          args.separator_position)
    llama3 = next((f for f in files if f.is_llama3_llmc), None)
    if llama3 is not None and args.tokenizer == "gpt2":
        raise UserError(f"{llama3.path} is an llm.c Llama-3 shard (magic {LLMC_LLAMA3_MAGIC}, uint32 ids): pass "
                        "--tokenizer with Llama-3's tokenizer.json (or hub repository), or --vocab-size 128256 "
                        "--separator-id 128000 --separator-position before")
    return Vocabulary.of(load_tokenizer(args.tokenizer, args.ranks_file, args.separator))


def text_cleaning(normalize: str, dedup: bool, dedup_memory: str) -> Cleaning:
    """text_to_mds.py's cleaning: normalisation, empty documents dropped, and with `dedup` exact repeats, in a table
    of `dedup_memory` (e.g. 1gb)."""
    return Cleaning(normalize=normalize, drop_empty=True, dedup_memory=parse_size(dedup_memory) if dedup else None)


def add_text_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the converters that tokenize text."""
    add_output_arguments(parser)
    parser.add_argument("--val-fraction", type=float, default=0.0005, help="share of documents in val (0: none)")
    parser.add_argument("--seed", type=int, default=2357, help="seed of the train/val split")
    parser.add_argument("--num-workers", type=int, default=os.cpu_count(), help="tokenizer processes")
    parser.add_argument("--max-docs", type=int, default=None, help="stop after this many documents")
    parser.add_argument("--state-interval", type=float, default=60.0,
                        help="seconds between saves of a local one-pass conversion's state; the same command "
                             "after a kill resumes from the last save")


def output_options(args: argparse.Namespace) -> ConversionOptions:
    """The options of add_output_arguments (token-file conversion needs no others)."""
    return ConversionOptions(
        block_size=args.block_size, shard_size=args.shard_size, compression=args.compression,
        hashes=tuple(h for h in args.hashes.split(",") if h), overwrite=args.overwrite,
        progress=not args.no_progress, staging_dir=args.staging,
    )


def text_options(args: argparse.Namespace) -> ConversionOptions:
    """The options of add_text_arguments: the output's, and how text becomes documents and splits."""
    return dataclasses.replace(
        output_options(args), val_fraction=args.val_fraction, seed=args.seed, num_workers=args.num_workers or 1,
        max_docs=args.max_docs, state_interval_s=args.state_interval,
    )


def add_parts_arguments(parser: argparse.ArgumentParser) -> None:
    """Conversion in parts: over several machines, or resumable part by part on one."""
    group = parser.add_argument_group("parts (local files, or a datasets stream by data file; text_parts.py)")
    group.add_argument("--num-parts", type=int, default=None,
                       help="split the input files into N parts; alone: run every unfinished part, then merge")
    group.add_argument("--part", default=None,
                       help="run only part I (0-based) of --num-parts; 'auto' reads RANK or SLURM_PROCID; 'array' "
                       "reads SLURM_ARRAY_TASK_ID (and N, without --num-parts, the array's size); in a Slurm job "
                       "array, --num-parts alone means --part array")
    group.add_argument("--merge", action="store_true", help="join the finished parts into --out")


def run_text_conversion(args: argparse.Namespace, inputs: list[str], source_kwargs: dict,
                        cleaning: Cleaning) -> str:
    """The body of every text converter's main(): options from the command line, then the core."""
    started = time.monotonic()
    options = text_options(args)
    if not args.merge:  # a Slurm array's task I converts part I
        asked = args.part
        args.part, args.num_parts = array_part(args.part, args.num_parts)
        if args.part != asked:
            print(f"Slurm array task {args.part}: part {args.part} of {args.num_parts}", flush=True)
    if args.part is None:  # a part is written under --staging, for the merge to upload
        check_s3_output(args.out)
    check_output_location(args.out, inputs)
    # One part of several runs beside the others' machines: it locks only its part (text_parts.py).
    with conversion_lock(args.out, args.staging) if args.part is None else nullcontext():
        tokenizer = load_tokenizer(args.tokenizer, args.ranks_file, args.separator)
        # The collector never walks the start-up's objects (modules, the tokenizer's tables) again: the
        # conversion loop allocates many short-lived containers, and the collections were ~10% of this
        # process's CPU per token, which bounds how many tokenizer processes it can feed.
        gc.freeze()
        metadata = convert_text(inputs, args.out, source_kwargs, cleaning, options, tokenizer,
                                num_parts=args.num_parts, part=args.part, merge=args.merge)
    if metadata is None:
        return (f"part {args.part} of {args.num_parts} done in {time.monotonic() - started:.1f} s; when every "
                "part is done, run the same command with --merge instead of --part")
    return summary(metadata, args.out, time.monotonic() - started)


def summary(metadata: DatasetMetadata, out: str, seconds: float) -> str:
    """Human-readable closing lines for a conversion."""
    separator = f"separator {metadata.separator_id} {metadata.separator_position} each document"
    lines = [f"wrote {out} ({metadata.tokenizer}, vocab {metadata.vocab_size}, {separator}, block_size "
             f"{metadata.block_size}, {metadata.dtype})"]
    tokens = 0
    for name, s in metadata.splits.items():
        tokens += s.tokens
        lines.append(f"  {name:5s} {s.documents:>10,} docs {s.tokens:>14,} tokens {s.samples:>11,} samples "
                     f"{s.dropped_tokens:>6,} dropped tail tokens {s.shards:>5} shards {s.bytes / 1e6:>9.1f} MB")
    replaced = metadata.extra.get("invalid_utf8_documents_replaced", 0)
    if replaced:
        lines.append(f"  {replaced} documents had invalid UTF-8 bytes, replaced with U+FFFD")
    dropped = {k: v for k, v in metadata.extra.items() if k in ("empty", "duplicates") and v}
    if dropped:
        lines.append("  dropped documents: " + ", ".join(f"{v:,} {k}" for k, v in dropped.items()))
    lines.append(f"  {seconds:.1f} s, {tokens / max(seconds, 1e-9) / 1e6:.2f} M tokens/s")
    return "\n".join(lines)
