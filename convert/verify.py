"""Check a converted dataset: index, shard hashes, sample counts and layout, token ids, metadata.

    python convert/verify.py data/owt                 # check everything, print statistics
    python convert/verify.py data/owt --decode 12     # also print train sample 12 as text
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone without installing

from tokstream.convert.verify import decode_sample, verify_dataset  # noqa: E402
from tokstream.errors import CommandLine, UserError, run_cli  # noqa: E402


def main() -> None:
    parser = CommandLine(__doc__)
    parser.add_argument("root", help="dataset root written by a converter: a local path or s3://bucket/prefix")
    parser.add_argument("--decode", type=int, metavar="K", help="print sample K as text")
    parser.add_argument("--split", default="train", help="split for --decode")
    parser.add_argument("--ranks-file", default=None, help="local ranks file for --decode (offline)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer for --decode (default: the one the metadata names; a tokenizer.json path)")
    args = parser.parse_args()
    if not args.root.startswith("s3://") and not Path(args.root).is_dir():
        raise UserError(f"{args.root} is not a directory")

    report = verify_dataset(args.root)
    meta = report.metadata
    if args.split not in meta.splits:
        raise UserError(f"--split {args.split}: {args.root} has no such split (it has {', '.join(meta.splits)})")
    print(f"{args.root}: {meta.format} v{meta.format_version}, {meta.tokenizer} (vocab {meta.vocab_size}, "
          f"separator {meta.separator_id} {meta.separator_position} each document), block_size {meta.block_size}, "
          f"{meta.dtype}")
    for name, split in report.splits.items():
        stats = meta.splits[name]
        print(f"  {name:5s} {stats.documents:>10,} docs {stats.tokens:>14,} tokens {split.samples:>11,} samples "
              f"{split.shards:>5} shards {split.bytes / 1e6:>9.1f} MB")
    if args.decode is not None:
        tokens, text = decode_sample(args.root, args.split, args.decode, meta, args.tokenizer, args.ranks_file)
        print(f"--- {args.split} sample {args.decode} ({len(tokens)} tokens) ---\n{text}")
    for problem in report.problems:
        print(f"PROBLEM {problem}", file=sys.stderr)
    if not report.ok:
        raise UserError(f"{len(report.problems)} problem(s) found in {args.root}")
    print("OK")


if __name__ == "__main__":
    run_cli(main)
