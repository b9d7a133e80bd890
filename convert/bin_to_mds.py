"""Existing token files -> block-aligned MDS shards: nanoGPT .bin, llm.c/modded-nanogpt shards, .npy arrays.

    python convert/bin_to_mds.py data/openwebtext/train.bin --val data/openwebtext/val.bin --out data/owt
    python convert/bin_to_mds.py more_val.bin --out data/owt-b --split val    # add a split to a local dataset
    python convert/bin_to_mds.py 'fineweb10B/fineweb_train_*.bin' --out data/fineweb --split train
    python convert/bin_to_mds.py owt_train_tokens.npy --out data/owt-npy
    python convert/bin_to_mds.py 'edu_fineweb10B/*_train_*.bin' --val 'edu_fineweb10B/*_val_*.bin' \
        --tokenizer llama3/tokenizer.json --out data/fineweb-llama3        # llm.c's Llama-3 shards
    python convert/bin_to_mds.py ids.npy --vocab-size 128256 --separator-id 128000 --separator-position before ...
    python convert/bin_to_mds.py \
        'hf://datasets/karpathy/fineweb-edu-100B-gpt2-token-shards/edu_fineweb_train_00000[2-9].bin' \
        --val hf://datasets/karpathy/fineweb-edu-100B-gpt2-token-shards/edu_fineweb_train_000001.bin --out data/edu

Inputs are concatenated in the order given (a quoted glob expands sorted) into one split. URLs (hf://
hub files, file://) are fetched one at a time into --staging (or the temp dir), at most two at once. The ids'
range and the document separator come from --tokenizer (default gpt2), or for files whose tokenizer
is at hand by name only, from --vocab-size and --separator-id.
"""

import glob
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone without installing

from tokstream.convert.cli import (add_output_arguments, add_vocabulary_arguments, output_options, summary,  # noqa: E402
                                   token_vocabulary)
from tokstream.convert.output_guard import check_output_location, check_s3_output, conversion_lock  # noqa: E402
from tokstream.convert.remote_token_files import expand_url, is_url  # noqa: E402
from tokstream.convert.token_conversion import convert_token_files  # noqa: E402
from tokstream.convert.token_files import FORMATS, open_token_file  # noqa: E402
from tokstream.errors import CommandLine, UserError, run_cli  # noqa: E402


def open_inputs(patterns: list[str], fmt: str) -> list:
    """Local files (globs expand sorted), opened; URLs (hf://, file://) listed, fetched one at a time later."""
    files: list = []
    for pattern in patterns:
        if is_url(pattern):
            files.extend(expand_url(pattern, fmt))
            continue
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise UserError(f"{pattern} matches no file")
        files.extend(open_token_file(path, fmt) for path in matches)
    return files


def main() -> None:
    parser = CommandLine(__doc__)
    parser.add_argument("inputs", nargs="+", help="token files or quoted globs, concatenated in this order")
    parser.add_argument("--split", default="train", help="split the inputs go to (default train)")
    parser.add_argument("--val", nargs="+", default=None, metavar="FILE",
                        help="token files for the val split, written in the same run")
    parser.add_argument("--format", choices=FORMATS, default="auto", help="input format (default: detect)")
    add_vocabulary_arguments(parser)
    add_output_arguments(parser)
    args = parser.parse_args()

    started = time.monotonic()
    options = output_options(args)
    check_s3_output(args.out)
    files = {args.split: open_inputs(args.inputs, args.format)}
    if args.val:
        if args.split == "val":
            raise UserError("--val with --split val: name the other split with --split")
        files["val"] = open_inputs(args.val, args.format)
    first_files = [split_files[0] for split_files in files.values()]  # a URL's header is a request: one per split
    check_output_location(args.out, [f.path for split_files in files.values() for f in split_files])
    with conversion_lock(args.out, args.staging):
        metadata = convert_token_files(files, args.out, token_vocabulary(args, first_files), options)
    print(summary(metadata, args.out, time.monotonic() - started))


if __name__ == "__main__":
    run_cli(main)
