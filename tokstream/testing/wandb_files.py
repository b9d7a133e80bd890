"""Reads an offline W&B run's records (WANDB_MODE=offline writes them to run-<id>.wandb), for the tests: wandb 0.31
no longer ships a reader of its own. The file is W&B's header (":W&B", magic 0xBEE1, version 0) and then LevelDB's log
format: 32 KiB blocks of chunks, each a 7-byte header (checksum, length, type) and its bytes, a record split over
chunks FIRST, MIDDLE..., LAST where it does not fit a block's rest; each record a wandb_internal_pb2.Record."""

import struct
from pathlib import Path

HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str | Path) -> list:
    """The file's records, parsed."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    if not data.startswith(HEADER):
        raise ValueError(f"{path} is not a W&B run file")
    parsed, pending, at = [], b"", len(HEADER)
    while at + 7 <= len(data):
        if BLOCK - at % BLOCK < 7:  # a block's tail too short for a chunk header is padding
            at += BLOCK - at % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[at:at + 7])
        if kind == 0 and length == 0:
            break  # zeros: the end of what was written
        chunk, at = data[at + 7:at + 7 + length], at + 7 + length
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            parsed.append(record)
    return parsed


def history(path: str | Path) -> list[dict]:
    """The run's logged steps: each {"_step": step, name: value, ...}, values decoded from JSON."""
    import json

    steps = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            steps.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                          for item in record.history.item})
    return steps


def run_record(path: str | Path):
    """The file's run record (its id, name, config, and where it was forked from, if it was)."""
    return next(r.run for r in records(path) if r.WhichOneof("record_type") == "run")
