"""Command-line options shared by the converters, so every CLI stays a thin layer over the core."""

import argparse
import os

from tokstream.conversion import ConversionOptions


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of every converter: where and how samples are written."""
    parser.add_argument("--out", required=True, help="output dataset root (gets SPLIT/ dirs and metadata.json)")
    parser.add_argument("--block-size", type=int, default=1024, help="tokens per block; samples hold block+1")
    parser.add_argument("--encoding", default="gpt2", help="tiktoken encoding (default gpt2)")
    parser.add_argument("--ranks-file", default=None, help="local GPT-2/r50k_base .tiktoken ranks file (offline)")
    parser.add_argument("--shard-size", default="64mb", help="MDS shard size limit")
    parser.add_argument("--compression", default=None, help="MDS shard compression: zstd or zstd:LEVEL")
    parser.add_argument("--hashes", default="xxh64", help="comma-separated shard hashes ('' for none)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_text_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the converters that tokenize text."""
    add_output_arguments(parser)
    parser.add_argument("--val-fraction", type=float, default=0.0005, help="share of documents in val (0: none)")
    parser.add_argument("--seed", type=int, default=2357, help="seed of the train/val split")
    parser.add_argument("--num-workers", type=int, default=os.cpu_count(), help="tokenizer processes")
    parser.add_argument("--max-docs", type=int, default=None, help="stop after this many documents")


def conversion_options(args: argparse.Namespace) -> ConversionOptions:
    return ConversionOptions(
        block_size=args.block_size, val_fraction=getattr(args, "val_fraction", 0.0), seed=getattr(args, "seed", 0),
        num_workers=getattr(args, "num_workers", 1) or 1, max_docs=getattr(args, "max_docs", None),
        shard_size=args.shard_size, compression=args.compression,
        hashes=tuple(h for h in args.hashes.split(",") if h), overwrite=args.overwrite,
        progress=not args.no_progress,
    )
