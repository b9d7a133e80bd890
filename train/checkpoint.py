"""Checkpoints: written atomically, newest complete one found on relaunch, last K kept."""

import os
import re
from pathlib import Path

import torch

CHECKPOINT_NAME = re.compile(r"^ckpt-(\d{8})\.pt$")


def checkpoint_path(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / f"ckpt-{step:08d}.pt"


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints, oldest first (temporary files of an interrupted save are ignored)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    return sorted(p for p in run_dir.iterdir() if CHECKPOINT_NAME.match(p.name))


def save_checkpoint(run_dir: str | os.PathLike, step: int, state: dict, keep: int) -> Path:
    """Write to a temporary name, fsync, rename: a crash mid-write leaves the previous one intact."""
    path = checkpoint_path(run_dir, step)
    temporary = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(temporary, "wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # make the rename itself durable
    finally:
        os.close(directory)
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)
    return path


def load_latest_checkpoint(run_dir: str | os.PathLike) -> tuple[Path, dict] | tuple[None, None]:
    """The newest checkpoint that loads; a damaged newest one falls back to the one before."""
    for path in reversed(list_checkpoints(run_dir)):
        try:
            return path, torch.load(path, map_location="cpu", weights_only=False)
        except Exception as err:  # truncated or corrupt file: say so and try the previous one
            print(f"warning: skipping unreadable checkpoint {path}: {type(err).__name__}: {err}")
    return None, None
