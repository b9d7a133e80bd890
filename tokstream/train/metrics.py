"""metrics.jsonl (one JSON line per step, written by rank 0) and the console line every log_interval."""

import json
import os
from pathlib import Path

from tokstream.object_store import is_s3

METRICS_FILE = "metrics.jsonl"


def _whole_lines(text: str) -> list[str]:
    """The complete lines: a kill (or a read) mid-write leaves a last line without its newline."""
    return [line for line in text.rpartition("\n")[0].splitlines() if line]


def _read_text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def read_records(run_dir: str | os.PathLike) -> list[dict]:
    """A run's metrics, one record per step, also while the run is still writing them. For a run
    in S3: the copy uploaded with its newest checkpoint."""
    if is_s3(run_dir):
        from tokstream.train.run_store import S3RunStore

        text = (S3RunStore(str(run_dir), local=".").read_bytes(METRICS_FILE) or b"").decode()
    else:
        text = _read_text(Path(run_dir) / METRICS_FILE)
    return [json.loads(line) for line in _whole_lines(text)]


class MetricsLog:
    def __init__(self, run_dir: str | os.PathLike, enabled: bool):
        self.path = Path(run_dir) / METRICS_FILE
        self.enabled = enabled

    def truncate_after(self, step: int) -> None:
        """Drop lines for steps after the checkpoint we resume from: they will be trained again."""
        if not self.enabled or not self.path.exists():
            return
        kept = [line for line in _whole_lines(_read_text(self.path)) if json.loads(line)["step"] <= step]
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text("".join(line + "\n" for line in kept))
        os.replace(temporary, self.path)

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
    return (f"step {record['step']}{tokens} loss {record['loss']:.4f}{val} lr {record['lr']:.2e} "
            f"{record['tokens_per_s']:,.0f} tok/s data_wait {record['data_wait_s'] * 1e3:.1f} ms{mfu}")
