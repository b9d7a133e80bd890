"""Converter throughput against the raw tokenizer, measured in one run on the same documents.

    python bench/convert_speed.py                 # builds a 160 MB corpus from ../shared/corpora
    python bench/convert_speed.py --mb 300 --workers 2
    python bench/convert_speed.py --tokenizer trained-bpe     # a Hugging Face tokenizer.json instead
    python bench/convert_speed.py --tokenizer llama3/tokenizer.json

Baseline: the raw tokenizer's own batch call with all cores over the documents already in memory:
tiktoken's `encode_ordinary_batch`, or for a tokenizer.json `tokenizers`' `encode_batch` (its Rust
threads). `trained-bpe` trains a 2,000-token byte-level BPE on ../shared/corpora first (offline
machines have no hub tokenizer). Converter: `python convert/owt_to_mds.py --tokenizer ...` end to
end, process start and imports included.
Peak RSS is that of the largest process of the conversion, at half and at full corpus size.
The parent's own CPU (reading, handing out chunks, packing, writing; not the tokenizer processes)
per million tokens says how many tokenizer cores one parent can feed: at the raw tokenizer's
per-core rate, it saturates at 1 / (per-core rate x parent CPU per token) cores. It is printed
with start-up (imports, loading the tokenizer) and once running: the full-size run's CPU less the
half-size run's, over the tokens between them.
The converter also runs with `--state-interval 0` (its resumable state saved after every batch
rather than once a minute): the worst case of what resumability costs.
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CORPORA = ROOT.parent / "shared" / "corpora"


def build_corpus(path: Path, megabytes: int, seed: int = 0) -> int:
    """Web-page-sized documents (a few KB) made of real paragraphs, in a seeded random order."""
    paragraphs = []
    for name in ("wikitext2_valid.txt", "tinyshakespeare.txt"):
        text = (CORPORA / name).read_text(encoding="utf-8")
        paragraphs += [p for p in text.split("\n\n") if p.strip()]
    rng = random.Random(seed)
    written = 0
    with open(path, "w", encoding="utf-8") as out:
        while written < megabytes * 1_000_000:
            doc = "\n\n".join(rng.choice(paragraphs) for _ in range(rng.randint(4, 24)))
            out.write(json.dumps({"text": doc}) + "\n")
            written += len(doc.encode("utf-8"))
    return written


def raw_tokenizer(path: Path, workers: int, name: str) -> None:
    """Child process: print seconds and tokens of the tokenizer's batch call over documents already in memory."""
    from tokstream.tokenizer import HuggingFaceTokenizer, load_tokenizer

    docs = [json.loads(line)["text"] for line in open(path, encoding="utf-8")]
    tokenizer = load_tokenizer(name)
    started = time.perf_counter()
    if isinstance(tokenizer, HuggingFaceTokenizer):  # RAYON_NUM_THREADS (set by the parent) sets its threads
        tokens = sum(len(e.ids) for e in tokenizer.backend.encode_batch(docs, add_special_tokens=False))
    else:
        tokens = sum(map(len, tokenizer.encoding.encode_ordinary_batch(docs, num_threads=workers)))
    print(time.perf_counter() - started, tokens + len(docs))  # + one separator per document


def train_bpe(path: Path) -> Path:
    """A 2,000-token byte-level BPE trained on ../shared/corpora, saved as tokenizer.json."""
    from tokstream.testing.bpe import train_bpe as train

    corpora = [(CORPORA / name).read_text(encoding="utf-8") for name in ("wikitext2_valid.txt", "tinyshakespeare.txt")]
    return train(path, corpora, ["<|endoftext|>"])


def run_child(args: list[str], env: dict | None = None) -> tuple[float, float, str, float]:
    """Wall seconds, peak RSS (MB, largest process of its tree), stdout and the process's own CPU seconds
    (its tokenizer processes, children of the forkserver, not included) of one fresh process."""
    started = time.perf_counter()
    child = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, **(env or {})))
    stdout = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)  # this child's own rusage, not every child's so far
    seconds = time.perf_counter() - started
    if status != 0:
        raise SystemExit(f"{args} failed with status {status}")
    return seconds, usage.ru_maxrss / 1024, stdout, usage.ru_utime + usage.ru_stime


def converter_run(path: Path, out: Path, workers: int, tokenizer: str, *extra: str
                  ) -> tuple[float, float, float, int]:
    """Wall seconds, peak RSS (MB), the converting process's own CPU seconds, and the tokens written."""
    seconds, rss, _, cpu = run_child([str(ROOT / "convert/owt_to_mds.py"), "--dataset", str(path), "--out", str(out),
                                 "--num-workers", str(workers), "--tokenizer", tokenizer, "--no-progress",
                                 "--overwrite", *extra])
    splits = json.loads((out / "metadata.json").read_text())["splits"]
    return seconds, rss, cpu, sum(split["tokens"] for split in splits.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=160, help="corpus size in MB of text")
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--workdir", default=None, help="where to put the corpus and outputs (default: a temp dir)")
    parser.add_argument("--tokenizer", default="gpt2",
                        help="tiktoken encoding, tokenizer.json, or trained-bpe (trained here on ../shared/corpora)")
    parser.add_argument("--raw", help=argparse.SUPPRESS)  # internal: run the baseline on this file
    args = parser.parse_args()
    if args.raw:
        return raw_tokenizer(Path(args.raw), args.workers, args.tokenizer)

    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        tmp = Path(tmp)
        tokenizer = str(train_bpe(tmp / "tokenizer.json")) if args.tokenizer == "trained-bpe" else args.tokenizer
        half, full = tmp / "half.jsonl", tmp / "full.jsonl"
        build_corpus(half, args.mb // 2)
        nbytes = build_corpus(full, args.mb)
        _, rss_half, cpu_half, tokens_half = converter_run(half, tmp / "out_half", args.workers, tokenizer)
        _, _, raw_out, _ = run_child([__file__, "--raw", str(full), "--workers", str(args.workers), "--tokenizer",
                                   tokenizer], env={"RAYON_NUM_THREADS": str(args.workers)})
        raw_s, tokens = float(raw_out.split()[0]), int(raw_out.split()[1])
        conv_s, rss_full, parent_cpu, tokens_full = converter_run(full, tmp / "out_full", args.workers, tokenizer)
        saving_s, _, _, _ = converter_run(full, tmp / "out_saving", args.workers, tokenizer, "--state-interval", "0")

    baseline = "tiktoken encode_ordinary_batch" if not tokenizer.endswith(".json") else "tokenizers encode_batch"
    print(f"corpus: {nbytes / 1e6:.0f} MB of text, {tokens / 1e6:.1f} M tokens, {args.workers} workers, "
          f"{os.cpu_count()} cores, tokenizer {args.tokenizer}")
    print(f"raw {baseline:31s}: {raw_s:7.2f} s  {tokens / raw_s / 1e6:6.2f} M tok/s  "
          f"{nbytes / raw_s / 1e6:6.2f} MB/s")
    print(f"owt_to_mds.py end to end           : {conv_s:7.2f} s  {tokens / conv_s / 1e6:6.2f} M tok/s  "
          f"{nbytes / conv_s / 1e6:6.2f} MB/s")
    print(f"  same, state saved every batch    : {saving_s:7.2f} s  {tokens / saving_s / 1e6:6.2f} M tok/s  "
          f"{nbytes / saving_s / 1e6:6.2f} MB/s")
    print(f"ratio_converter_vs_raw_tokenizer={raw_s / conv_s:.2f} "
          f"ratio_state_every_batch_vs_default={conv_s / saving_s:.2f}")
    print(f"peak RSS (largest process): {rss_half:.0f} MB at {args.mb // 2} MB of text, "
          f"{rss_full:.0f} MB at {args.mb} MB of text")
    per_core = tokens / raw_s / args.workers
    marginal = (parent_cpu - cpu_half) / (tokens_full - tokens_half)  # start-up cancels out
    print(f"parent CPU: {parent_cpu:.2f} s = {parent_cpu / tokens * 1e6:.4f} CPU-s per M tokens with start-up; "
          f"{marginal * 1e6:.4f} per M tokens once running (the {args.mb} MB run less the {args.mb // 2} MB one)")
    print(f"at {per_core / 1e6:.2f} M tokens/s per tokenizer core, one parent saturates at "
          f"{1 / (per_core * marginal):.0f} cores (with start-up at this size: {1 / (per_core * parent_cpu / tokens):.0f})")


if __name__ == "__main__":
    main()
