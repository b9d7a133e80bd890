"""Plain-text corpora -> block-aligned MDS shards, with optional normalisation and exact dedup.

    python convert/text_to_mds.py books/ --doc-per paragraph --out data/books
    python convert/text_to_mds.py crawl/*.txt --doc-per line --normalize nfc+whitespace --dedup --out data/crawl

Tokenization, split and output are those of owt_to_mds.py. Empty documents are dropped and counted.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone without installing

from tokstream.cleaning import NORMALIZE_MODES, CleaningStats, clean_documents  # noqa: E402
from tokstream.cli import add_text_arguments, conversion_options  # noqa: E402
from tokstream.conversion import convert_documents, summary  # noqa: E402
from tokstream.errors import run_cli  # noqa: E402
from tokstream.format import parse_size  # noqa: E402
from tokstream.sources import TXT_DOC_MODES, open_source  # noqa: E402
from tokstream.tokenizer import load_tokenizer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", help="text files or folders (.txt; .jsonl/.parquet also read)")
    parser.add_argument("--doc-per", choices=TXT_DOC_MODES, default="file",
                        help="one document per file, per line, or per blank-line-separated paragraph")
    parser.add_argument("--text-column", default="text", help="field holding the text in .jsonl/.parquet")
    parser.add_argument("--normalize", choices=NORMALIZE_MODES, default="none",
                        help="Unicode NFC, optionally with whitespace clean-up (off by default)")
    parser.add_argument("--dedup", action="store_true", help="drop exact repeats of earlier documents")
    parser.add_argument("--dedup-memory", default="1gb", help="fixed memory of the dedup table (8 bytes/doc)")
    add_text_arguments(parser)
    args = parser.parse_args()

    started = time.monotonic()
    options = conversion_options(args)
    options.validate()
    source = open_source(args.inputs, text_column=args.text_column, txt_docs=args.doc_per)
    source.description.update(normalize=args.normalize, dedup=args.dedup)
    tokenizer = load_tokenizer(args.encoding, args.ranks_file)
    cleaning = CleaningStats()
    documents = clean_documents(source, args.normalize, parse_size(args.dedup_memory) if args.dedup else None,
                                cleaning)
    metadata = convert_documents(source, tokenizer, args.out, options, documents=documents, reports=(cleaning,))
    print(summary(metadata, args.out, time.monotonic() - started))


if __name__ == "__main__":
    run_cli(main)
