"""Plain-text corpora -> block-aligned MDS shards, with optional normalisation and exact dedup.

    python convert/text_to_mds.py books/ --doc-per paragraph --out data/books
    python convert/text_to_mds.py crawl/*.txt --doc-per line --normalize nfc+whitespace --dedup --out data/crawl

Tokenization, split and output are those of owt_to_mds.py. Empty documents are dropped and counted.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone without installing

from tokstream.convert.cleaning import NORMALIZE_MODES  # noqa: E402
from tokstream.convert.cli import add_parts_arguments, add_text_arguments, run_text_conversion, text_cleaning  # noqa: E402
from tokstream.convert.sources import TXT_DOC_MODES  # noqa: E402
from tokstream.errors import CommandLine, run_cli  # noqa: E402


def main() -> None:
    parser = CommandLine(__doc__)
    parser.add_argument("inputs", nargs="+", help="text files or folders (.txt; .jsonl/.parquet also read)")
    parser.add_argument("--doc-per", choices=TXT_DOC_MODES, default="file",
                        help="one document per file, per line, or per blank-line-separated paragraph")
    parser.add_argument("--text-column", default="text", help="field holding the text in .jsonl/.parquet")
    parser.add_argument("--normalize", choices=NORMALIZE_MODES, default="none",
                        help="Unicode NFC, optionally with whitespace clean-up (off by default)")
    parser.add_argument("--dedup", action="store_true", help="drop exact repeats of earlier documents")
    parser.add_argument("--dedup-memory", default="1gb", help="fixed memory of the dedup table (8 bytes/doc)")
    add_text_arguments(parser)
    add_parts_arguments(parser)
    args = parser.parse_args()

    cleaning = text_cleaning(args.normalize, args.dedup, args.dedup_memory)
    print(run_text_conversion(args, args.inputs, {"text_column": args.text_column, "txt_docs": args.doc_per},
                              cleaning))


if __name__ == "__main__":
    run_cli(main)
