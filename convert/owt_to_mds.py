"""OpenWebText (or any text corpus) -> block-aligned MDS shards, nanoGPT's prepare.py as a streaming converter.

    python convert/owt_to_mds.py --out data/owt                     # the hub's OpenWebText
    python convert/owt_to_mds.py --dataset corpus/ --out data/mine  # local .txt/.jsonl/.parquet
"""

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone without installing

from tokstream.conversion import ConversionOptions, convert_documents, summary  # noqa: E402
from tokstream.errors import run_cli  # noqa: E402
from tokstream.sources import TXT_DOC_MODES, open_source  # noqa: E402
from tokstream.tokenizer import load_tokenizer  # noqa: E402

DEFAULT_DATASET = "Skylion007/openwebtext"
# Script-based hub datasets such as OpenWebText load in recent `datasets` only through the
# hub's parquet conversion; use --revision main for a repository's own files.
DEFAULT_REVISION = "refs/convert/parquet"


def add_conversion_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by every text converter."""
    parser.add_argument("--out", required=True, help="output dataset root (gets train/, val/, metadata.json)")
    parser.add_argument("--block-size", type=int, default=1024, help="tokens per block; samples hold block+1")
    parser.add_argument("--val-fraction", type=float, default=0.0005, help="share of documents in val (0: none)")
    parser.add_argument("--seed", type=int, default=2357, help="seed of the train/val split")
    parser.add_argument("--num-workers", type=int, default=os.cpu_count(), help="tokenizer processes")
    parser.add_argument("--max-docs", type=int, default=None, help="stop after this many documents")
    parser.add_argument("--encoding", default="gpt2", help="tiktoken encoding (default gpt2)")
    parser.add_argument("--ranks-file", default=None, help="local GPT-2/r50k_base .tiktoken ranks file (offline)")
    parser.add_argument("--shard-size", default="64mb", help="MDS shard size limit")
    parser.add_argument("--compression", default=None, help="MDS shard compression, e.g. zstd or zstd:7")
    parser.add_argument("--hashes", default="xxh64", help="comma-separated shard hashes ('' for none)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def conversion_options(args: argparse.Namespace) -> ConversionOptions:
    return ConversionOptions(
        block_size=args.block_size, val_fraction=args.val_fraction, seed=args.seed,
        num_workers=args.num_workers, max_docs=args.max_docs, shard_size=args.shard_size,
        compression=args.compression, hashes=tuple(h for h in args.hashes.split(",") if h),
        overwrite=args.overwrite, progress=not args.no_progress,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", nargs="+", default=[DEFAULT_DATASET],
                        help="hub dataset name, or local files/folders (.txt, .jsonl, .json, .parquet)")
    parser.add_argument("--revision", default=DEFAULT_REVISION, help="hub dataset revision")
    parser.add_argument("--text-column", default="text", help="field holding the document text")
    parser.add_argument("--txt-docs", choices=TXT_DOC_MODES, default="file",
                        help=".txt files: one document per file, line or blank-line paragraph")
    add_conversion_arguments(parser)
    args = parser.parse_args()

    started = time.monotonic()
    options = conversion_options(args)
    options.validate()
    source = open_source(args.dataset, text_column=args.text_column, txt_docs=args.txt_docs,
                         revision=args.revision)
    tokenizer = load_tokenizer(args.encoding, args.ranks_file)
    metadata = convert_documents(source, tokenizer, args.out, options)
    print(summary(metadata, args.out, time.monotonic() - started))


if __name__ == "__main__":
    run_cli(main)
