"""Existing token files -> block-aligned MDS shards: nanoGPT .bin, llm.c/modded-nanogpt shards, .npy arrays.

    python convert/bin_to_mds.py data/openwebtext/train.bin --val data/openwebtext/val.bin --out data/owt
    python convert/bin_to_mds.py more_val.bin --out data/owt-b --split val    # add a split to a local dataset
    python convert/bin_to_mds.py 'fineweb10B/fineweb_train_*.bin' --out data/fineweb --split train
    python convert/bin_to_mds.py owt_train_tokens.npy --out data/owt-npy

Inputs are concatenated in the order given (a quoted glob expands sorted) into one split.
"""

import argparse
import glob
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone without installing

from tokstream.cli import add_output_arguments, output_options, summary  # noqa: E402
from tokstream.errors import UserError, run_cli  # noqa: E402
from tokstream.token_conversion import convert_token_files  # noqa: E402
from tokstream.token_files import FORMATS, open_token_file  # noqa: E402
from tokstream.tokenizer import load_tokenizer  # noqa: E402


def expand(patterns: list[str]) -> list[str]:
    paths: list[str] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise UserError(f"{pattern} matches no file")
        paths.extend(matches)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", help="token files or quoted globs, concatenated in this order")
    parser.add_argument("--split", default="train", help="split the inputs go to (default train)")
    parser.add_argument("--val", nargs="+", default=None, metavar="FILE",
                        help="token files for the val split, written in the same run")
    parser.add_argument("--format", choices=FORMATS, default="auto", help="input format (default: detect)")
    add_output_arguments(parser)
    args = parser.parse_args()

    started = time.monotonic()
    options = output_options(args)
    files = {args.split: [open_token_file(path, args.format) for path in expand(args.inputs)]}
    if args.val:
        if args.split == "val":
            raise UserError("--val with --split val: name the other split with --split")
        files["val"] = [open_token_file(path, args.format) for path in expand(args.val)]
    tokenizer = load_tokenizer(args.encoding, args.ranks_file)
    metadata = convert_token_files(files, args.out, tokenizer.name, tokenizer.vocab_size, tokenizer.eot_id, options)
    print(summary(metadata, args.out, time.monotonic() - started))


if __name__ == "__main__":
    run_cli(main)
