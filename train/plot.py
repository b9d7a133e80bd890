"""Plot loss curves from one or more runs' metrics.jsonl to a PNG: training loss, validation loss,
and for a mixture each source's validation loss; over steps, with the tokens consumed on the top axis
(the first run's) and each phase's start marked. On each run's curve: every relaunch (after a preemption, or
another stop), every rewind (resume_from, with the abandoned branch's loss faded) and every skip (skip_steps).

    python train/plot.py runs/gpt2-124m-owt --out loss.png
    python train/plot.py runs/a runs/b --out compare.png
"""

import sys
from pathlib import Path

import numpy as np

import matplotlib

matplotlib.use("Agg")  # no display on cluster nodes
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone without installing

from tokstream.errors import CommandLine, run_cli  # noqa: E402
from tokstream.train.metrics import run_metrics  # noqa: E402
from tokstream.train.rewind import abandoned_records  # noqa: E402


def plot_runs(run_dirs: list[str], out: str) -> tuple[list[str], list[tuple[str, int]]]:
    """Write the PNG; returns the curves' labels, in drawing order, and the marks: (what, step) each."""
    figure, axis = plt.subplots(figsize=(8, 5))
    marks: list[tuple[str, int]] = []
    for index, run_dir in enumerate(run_dirs):
        records = run_metrics(run_dir)
        if index == 0:
            mark_tokens_and_phases(axis, records)
        name = Path(run_dir).name
        line, = axis.plot([r["step"] for r in records], [r["loss"] for r in records], label=f"{name} train", lw=1)
        marks += mark_relaunches_and_skips(axis, run_dir, records, line.get_color())
        val = [r for r in records if "val_loss" in r]
        if val:
            axis.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label=f"{name} val", ms=3)
        sources = sorted({source for r in val for source in r.get("val_loss_per_source", {})})
        for source in sources:
            points = [(r["step"], r["val_loss_per_source"][source]) for r in val
                      if source in r.get("val_loss_per_source", {})]
            axis.plot(*zip(*points), "s--", label=f"{name} val {source}", ms=3, lw=1)
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("cross-entropy loss (nats)")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    return [line.get_label() for line in axis.get_lines() if not line.get_label().startswith("_")], marks


# How each kind of relaunch is drawn: a vertical line at the step it resumed from.
RELAUNCH_STYLE = {"preemption": ("goldenrod", "--"), "rewind": ("tab:red", "-"), "restart": ("gray", "--"),
                  "end": ("gray", ":")}


def mark_relaunches_and_skips(axis, run_dir: str, records: list[dict], color: str) -> list[tuple[str, int]]:
    """Each relaunch's line (its first metrics line says from which step, after what), a rewind's abandoned branch
    (run_dir/abandoned/*/metrics.jsonl past the step it rewound to) faded, and a triangle where a skip left data out."""
    marks = []
    for record in records:
        relaunch = record.get("relaunch")
        if isinstance(relaunch, dict) and isinstance(relaunch.get("from_step"), int):
            after, step = str(relaunch.get("after")), relaunch["from_step"]
            line_color, style = RELAUNCH_STYLE.get(after, RELAUNCH_STYLE["restart"])
            axis.axvline(step, color=line_color, ls=style, lw=0.8, alpha=0.7)
            axis.annotate(after, (step, 0), xycoords=("data", "axes fraction"), xytext=(2, 3),
                          textcoords="offset points", fontsize=7, color=line_color, rotation=90)
            marks.append((after, step))
            if after == "rewind":
                marks += _abandoned(axis, run_dir, step, color)
        skipped = record.get("skipped")
        if isinstance(skipped, dict) and "steps" in skipped:
            first, last = skipped["steps"]
            axis.plot([record["step"]], [record["loss"]], "v", color="tab:purple", ms=6)
            axis.annotate(f"skip {first}-{last}", (record["step"], record["loss"]), xytext=(4, 6),
                          textcoords="offset points", fontsize=7, color="tab:purple")
            marks.append(("skip", record["step"]))
    return marks


def _abandoned(axis, run_dir: str, step: int, color: str) -> list[tuple[str, int]]:
    """The loss of the branch a rewind to `step` moved aside, past `step`, faded (the newest such branch)."""
    kept = abandoned_records(run_dir, step)
    if kept:
        axis.plot([r["step"] for r in kept], [r["loss"] for r in kept], color=color, lw=1, alpha=0.3,
                  label=f"{Path(run_dir).name} abandoned at the rewind to {step}")
    return [("abandoned", kept[0]["step"])] if kept else []



def mark_tokens_and_phases(axis, records: list[dict]) -> None:
    """A top axis of tokens consumed (which a batch ramp or a longer block makes uneven in steps), and a
    dotted line where each phase after the first starts."""
    counted = [r for r in records if "tokens" in r]
    if len(counted) < 2:
        return
    steps = np.array([0] + [r["step"] for r in counted], dtype=float)
    tokens = np.array([0] + [r["tokens"] for r in counted], dtype=float)
    top = axis.secondary_xaxis("top", functions=(lambda x: np.interp(x, steps, tokens),
                                                 lambda t: np.interp(t, tokens, steps)))
    top.set_xlabel("tokens consumed")
    for before, record in zip(counted, counted[1:]):
        if record.get("phase", 0) != before.get("phase", 0):
            axis.axvline(before["step"], color="gray", ls=":", lw=1)
            axis.annotate(f"phase {record['phase']}", (before["step"], 1), xycoords=("data", "axes fraction"),
                          xytext=(3, -12), textcoords="offset points", fontsize=8, color="gray")



def main() -> None:
    parser = CommandLine(__doc__)
    parser.add_argument("run_dirs", nargs="+")
    parser.add_argument("--out", default="loss.png")
    args = parser.parse_args()
    plot_runs(args.run_dirs, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    run_cli(main, interrupted="interrupted: the plot may be incomplete; run it again")
