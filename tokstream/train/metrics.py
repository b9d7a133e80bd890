"""metrics.jsonl (one JSON line per step, written by rank 0) and the console line every log_interval."""

import json
import os
import sys
from pathlib import Path

from tokstream.errors import UserError
from tokstream.object_store import is_s3

METRICS_FILE = "metrics.jsonl"


def _whole_lines(text: str) -> list[tuple[int, str]]:
    """The complete lines, each with its number in the file: a kill (or a read) mid-write leaves a last line
    without its newline."""
    return [(number, line) for number, line in enumerate(text.rpartition("\n")[0].split("\n"), start=1) if line]


def step_record(line: str) -> dict | None:
    """The record of one step a line holds, or None: a line cut by a kill and then appended to, or edited."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    for key, kinds in RECORD_FIELDS.items():
        if key not in record and key not in ("step", "loss"):
            continue
        value = record.get(key)
        if not isinstance(value, kinds) or isinstance(value, bool):
            return None
    if ("ranks" in record) != ("nodes" in record):
        return None
    return record


# What the readers of metrics.jsonl (the relaunch, the ledger, the plot) take from a step's line, and its type; step
# and loss are in every line.
RECORD_FIELDS = {"step": int, "loss": (int, float), "tokens": int, "phase": int, "ranks": int, "nodes": int,
                 "val_loss": (int, float), "samples": list, "val_loss_per_source": dict, "data": str,
                 "read": str}


def _records(text: str, where: object) -> list[tuple[str, dict | None]]:
    """Each complete line with its record (None for a damaged one), after one warning on stderr naming the
    damaged lines: a run's log must not stop its relaunch, its ledger or its plot."""
    lines = _whole_lines(text)
    parsed = [(line, step_record(line)) for _, line in lines]
    damaged = [number for (number, _), (_, record) in zip(lines, parsed) if record is None]
    if damaged:
        listed = ", ".join(map(str, damaged[:10])) + (f" and {len(damaged) - 10} more" if len(damaged) > 10 else "")
        print(f"warning: {where} line{'s' * (len(damaged) > 1)} {listed} {'is' if len(damaged) == 1 else 'are'} not a "
              "step's record (cut by a kill, or edited): skipped; delete or repair them to silence this",
              file=sys.stderr, flush=True)
    return parsed


def _read_text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def read_records(run_dir: str | os.PathLike) -> list[dict]:
    """A run's metrics, one record per step, also while the run is still writing them (damaged lines skipped,
    with a warning). For a run in S3: the copy uploaded with its newest checkpoint."""
    if is_s3(run_dir):
        from tokstream.train.run_store import S3RunStore

        text = (S3RunStore(str(run_dir), local=".").read_bytes(METRICS_FILE) or b"").decode(errors="replace")
    else:
        text = _read_text(Path(run_dir) / METRICS_FILE)
    return [record for _, record in _records(text, f"{str(run_dir).rstrip('/')}/{METRICS_FILE}") if record is not None]


def parse_records(data: bytes, where: object) -> list[dict]:
    """The step records in a copy of metrics.jsonl (damaged lines skipped, with a warning naming `where`)."""
    return [record for _, record in _records(data.decode(errors="replace"), where) if record is not None]


def run_metrics(run_dir: str) -> list[dict]:
    """read_records(run_dir), refused in one line when it holds none (no run there, or none logged yet)."""
    path = Path(run_dir) / METRICS_FILE
    if not is_s3(run_dir) and not path.is_file():
        raise UserError(f"{path} does not exist: is {run_dir} a run directory?")
    records = read_records(run_dir)
    if not records:  # an S3 prefix without metrics reads as empty, as does a run that has not logged a step
        raise UserError(f"{run_dir} holds no metrics: is it a run directory, and has its run logged a step?")
    return records


class MetricsLog:
    def __init__(self, run_dir: str | os.PathLike, enabled: bool):
        self.path = Path(run_dir) / METRICS_FILE
        self.enabled = enabled

    def truncate_after(self, step: int) -> int:
        """Drop lines for steps after the checkpoint we resume from: they will be trained again. The last step the
        file held before (0 if none): what earlier launches logged."""
        if not self.enabled or not self.path.exists():
            return 0
        # A damaged line is kept as it is (it may be all that is left of a step): the readers skip it.
        records = _records(_read_text(self.path), self.path)
        kept = [line for line, record in records if record is None or record["step"] <= step]
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text("".join(line + "\n" for line in kept))
        os.replace(temporary, self.path)
        return max((record["step"] for _, record in records if record is not None), default=0)

    def last_step(self) -> int:
        """The last step this run's metrics.jsonl holds (0 if none): what earlier launches logged."""
        if not self.enabled or not self.path.exists():
            return 0
        return max((record["step"] for _, record in _records(_read_text(self.path), self.path) if record is not None),
                   default=0)

    def replace(self, data: bytes) -> None:
        """Start from another copy of the run's metrics (an S3 run's, on a node that may have none)."""
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_bytes(data)

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as out:
                out.write(json.dumps(record) + "\n")


def console_line(record: dict) -> str:
    """The human summary of one step's record."""
    val = f" val_loss {record['val_loss']:.4f}" if "val_loss" in record else ""
    if "val_loss_per_source" in record:
        val += " (" + ", ".join(f"{name} {loss:.4f}" for name, loss in record["val_loss_per_source"].items()) + ")"
    mfu = f" mfu {record['mfu']:.1%}" if "mfu" in record else ""
    tokens = f" tokens {record['tokens']:,}" if "tokens" in record else ""
    norm = f" grad_norm {record['grad_norm']:.3g}{' (clipped)' if record.get('clipped') else ''}" \
        if "grad_norm" in record else ""
    waited = f" ({record['data_wait_fraction']:.0%})" if "data_wait_fraction" in record else ""
    return (f"step {record['step']}{tokens} loss {record['loss']:.4f}{val}{norm} lr {record['lr']:.2e} "
            f"{record['tokens_per_s']:,.0f} tok/s data_wait {record['data_wait_s'] * 1e3:.1f} ms{waited}{mfu}")
