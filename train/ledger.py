"""Which samples each rank read in a step of a run, per source, from what the run recorded (its config, the
identity of its data, the ranks of each step), without running the model; also for steps not made yet.

    python train/ledger.py runs/gpt2 --step 48213
    python train/ledger.py runs/gpt2 --steps 100:110 --decode      # steps 100 to 110, each sample as text
    python train/ledger.py runs/gpt2 --step 7 --json                # one JSON line per step
    python train/ledger.py runs/gpt2 --step 7 data.remote=/mnt/owt  # the run's data, where it lies here
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone without installing

from tokstream.train.cpu_dispatch import prefer_avx2_sort  # noqa: E402

prefer_avx2_sort()  # numpy's kernels as the trainer's here: the ledger's orders break ties as its readers do

from tokstream.errors import CommandLine, UserError, run_cli  # noqa: E402


def step_range(text: str) -> range:
    """FIRST:LAST (both counted, FIRST <= LAST), or one step alone."""
    first, colon, last = text.partition(":")
    try:
        steps = range(int(first), int(last if colon else first) + 1)
    except ValueError:
        raise UserError(f"--steps {text}: give FIRST:LAST, e.g. --steps 100:110") from None
    if not steps:
        raise UserError(f"--steps {text}: FIRST is after LAST")
    return steps


def main() -> None:
    parser = CommandLine(__doc__)
    parser.add_argument("run_dir", help="the run's run_dir: a path or s3://bucket/prefix")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--step", type=int, help="a step, counted from 1 as metrics.jsonl counts")
    which.add_argument("--steps", metavar="FIRST:LAST", help="steps FIRST to LAST (both counted)")
    parser.add_argument("--decode", action="store_true", help="also each sample's text")
    parser.add_argument("--json", action="store_true", help="one JSON object per step")
    parser.add_argument("--ranks", type=int, help="ranks to deal the step to (default: what ran it)")
    parser.add_argument("--nodes", type=int, help="nodes of those ranks (default 1 with --ranks)")
    parser.add_argument("--tokenizer", help="tokenizer for --decode (default: the one each dataset's metadata names)")
    parser.add_argument("--ranks-file", help="local tiktoken ranks file for --decode (offline)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="where the run's data lies here, e.g. data.local=DIR")
    args = parser.parse_intermixed_args()  # settings before or after the options
    if (args.tokenizer or args.ranks_file) and not args.decode:
        raise UserError("--tokenizer and --ranks-file say how to decode: they come with --decode")
    steps = [args.step] if args.step is not None else step_range(args.steps)

    from tokstream.train.ledger import Ledger

    ledger = Ledger.of_run(args.run_dir, args.overrides)
    try:
        for step in steps:
            reads = ledger.step(step, args.ranks, args.nodes)
            texts = [ledger.texts(reads.phase, rank, args.tokenizer, args.ranks_file) for rank in reads.samples] \
                if args.decode else None
            print(json_line(ledger, reads, texts) if args.json else "\n".join(text_lines(ledger, reads, texts)), flush=True)
    finally:
        ledger.close()


def json_line(ledger, reads, texts: list[list[str]] | None) -> str:
    record = {"step": reads.step, "phase": reads.phase.index, "ranks": reads.ranks, "nodes": reads.nodes,
              "recorded": reads.recorded, "samples": reads.samples.tolist(),
              "sources": [ledger.sources(reads.phase, rank) for rank in reads.samples]}
    if texts is not None:
        record["texts"] = texts
    return json.dumps(record, ensure_ascii=False)


def text_lines(ledger, reads, texts: list[list[str]] | None) -> list[str]:
    how = "as the run recorded" if reads.recorded else "not recorded: the last launch's, or as given"
    data = ", ".join(ledger.recipe.dataset(reads.phase).source_names)
    what = f"{reads.phase.name}, {data}" if len(ledger.recipe.phases) > 1 else data
    lines = [f"step {reads.step} ({what}): {reads.samples.size} samples, {reads.ranks} "
             f"rank{'s' * (reads.ranks > 1)} on {reads.nodes} node{'s' * (reads.nodes > 1)} ({how})"]
    several = len(ledger.recipe.dataset(reads.phase).sources) > 1  # a mixture: each id with its source
    for rank, ids in enumerate(reads.samples):
        sources = ledger.sources(reads.phase, ids)
        lines.append(f"  rank {rank}: " + " ".join(f"{name}:{i}" if several else str(i) for name, i in sources))
        if texts is not None:
            for (name, i), text in zip(sources, texts[rank]):
                lines.append(f"    {name} {i}: {json.dumps(text, ensure_ascii=False)}")
    return lines


if __name__ == "__main__":
    run_cli(main, interrupted="interrupted: the ledger only reads; nothing was written")
