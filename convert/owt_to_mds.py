"""OpenWebText (or any text corpus) -> block-aligned MDS shards, nanoGPT's prepare.py as a streaming converter.

    python convert/owt_to_mds.py --out data/owt                     # the hub's OpenWebText
    python convert/owt_to_mds.py --dataset corpus/ --out data/mine  # local .txt/.jsonl/.parquet
    python convert/owt_to_mds.py --dataset HuggingFaceFW/fineweb-edu --name sample-10BT \
        --out data/fineweb-edu-10bt                                 # a hub dataset's configuration
    python convert/owt_to_mds.py --dataset parquet --data-files 'dump/*.parquet' --out data/dump  # a datasets builder

A hub dataset (or a builder over --data-files) streams through `datasets`; a rerun after a kill
continues the stream from its saved position instead of streaming from the start again.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone without installing

from tokstream.convert.cleaning import Cleaning  # noqa: E402
from tokstream.convert.cli import add_parts_arguments, add_text_arguments, run_text_conversion  # noqa: E402
from tokstream.convert.sources import TXT_DOC_MODES  # noqa: E402
from tokstream.errors import CommandLine, run_cli  # noqa: E402

DEFAULT_DATASET = "Skylion007/openwebtext"
# Script-based hub datasets such as OpenWebText load in recent `datasets` only through the
# hub's parquet conversion; use --revision main for a repository's own files.
DEFAULT_REVISION = "refs/convert/parquet"


def main() -> None:
    parser = CommandLine(__doc__)
    parser.add_argument("--dataset", nargs="+", default=[DEFAULT_DATASET],
                        help="hub dataset name, or local files/folders (.txt, .jsonl, .json, .parquet)")
    parser.add_argument("--revision", default=None,
                        help=f"hub dataset revision (default: {DEFAULT_REVISION} for {DEFAULT_DATASET}, else the "
                             "dataset's default branch)")
    parser.add_argument("--name", default=None, help="hub dataset configuration, e.g. sample-10BT")
    parser.add_argument("--split", default="train", help="hub dataset split to read (default train)")
    parser.add_argument("--data-files", nargs="+", default=None,
                        help="data-file patterns of the dataset (hub paths, or local files for a builder such as "
                             "parquet or json)")
    parser.add_argument("--text-column", default="text", help="field holding the document text")
    parser.add_argument("--txt-docs", choices=TXT_DOC_MODES, default="file",
                        help=".txt files: one document per file, line or blank-line paragraph")
    add_text_arguments(parser)
    add_parts_arguments(parser)
    args = parser.parse_args()

    source_kwargs = {"text_column": args.text_column, "txt_docs": args.txt_docs, "hub_split": args.split,
                     "hub_config": args.name, "data_files": args.data_files,
                     "revision": args.revision or (DEFAULT_REVISION if args.dataset == [DEFAULT_DATASET] else None)}
    # No cleaning: the token stream stays exactly nanoGPT's (an empty document is one end-of-text token).
    print(run_text_conversion(args, args.dataset, source_kwargs, Cleaning()))


if __name__ == "__main__":
    run_cli(main)
