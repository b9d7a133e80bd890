"""Checkpoints: assembled from the run's stateful components, written atomically, newest complete one
found on relaunch, last K kept.

A checkpoint is a dict with one entry per component (`model`, `optimizer`, `loader`, `rng`,
`progress`: whatever has `state_dict()` / `load_state_dict()`) and `run`, the facts a relaunch is
checked against before anything is loaded (config, batch plan, dataset identity).
"""

import os
import pickle
import re
from pathlib import Path
from typing import Protocol

import torch

from tokstream.errors import UserError
from tokstream.train.distributed import Distributed

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
    """The newest checkpoint that loads; a damaged newest one falls back to the one before.

    Checkpoints that exist but none of which loads are refused: starting over from step 0 would
    silently throw the run away.
    """
    failures = []
    for path in reversed(list_checkpoints(run_dir)):
        try:
            # Data only: a checkpoint in shared storage must not be able to run code on the nodes
            # that resume from it, and this trainer writes nothing but tensors and plain values.
            return path, torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # truncated or corrupt file: say so and try the previous one
            if isinstance(err, pickle.UnpicklingError) and "Weights only load failed" in str(err):
                raise UserError(f"{path} holds objects other than tensors and plain values, which a checkpoint "
                                "of this trainer never does (or it is from a release before 2026-11-22): not "
                                "loaded; remove it to resume from the one before") from None
            print(f"warning: skipping unreadable checkpoint {path}: {type(err).__name__}: {err}")
            failures.append(path)
    if failures:
        raise UserError(f"none of the {len(failures)} checkpoints in {run_dir} can be read (newest: {failures[0].name}): "
                        "move them away to start the run over, or point run_dir at a copy that reads")
    return None, None


def remove_unfinished_saves(run_dir: str | os.PathLike) -> list[Path]:
    """Temporary files of saves that a kill interrupted (a run_dir belongs to one job at a time)."""
    unfinished = sorted(Path(run_dir).glob("ckpt-*.pt.tmp*"))
    for path in unfinished:
        path.unlink(missing_ok=True)
    return unfinished


class Stateful(Protocol):
    def state_dict(self) -> object: ...

    def load_state_dict(self, state) -> None: ...


def find_latest(run_dir: str | os.PathLike) -> tuple[Path, dict] | tuple[None, None]:
    """The newest complete checkpoint of a run, as written (nothing is restored yet)."""
    path, saved = load_latest_checkpoint(run_dir)
    if saved is not None and "progress" not in saved:
        raise UserError(f"{path} was written before checkpoints were assembled from components (tokstream "
                        "before the tokstream.train package): resume it with that release, or use a new run_dir")
    return path, saved


class Checkpointer:
    """Saves and restores a run's components in its run_dir; rank 0 writes, every rank takes part."""

    def __init__(self, run_dir: str | os.PathLike, keep: int, dist: Distributed, components: dict[str, Stateful],
                 run_record: dict):
        self.run_dir, self.keep, self.dist = Path(run_dir), keep, dist
        self.components, self.run_record = components, run_record
        self.saved_step: int | None = None  # the step the newest checkpoint holds
        if dist.master:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            for path in remove_unfinished_saves(self.run_dir):
                print(f"removed {path.name}, a save that was interrupted")
        dist.barrier()

    def restore(self, saved: dict) -> None:
        for name, component in self.components.items():
            component.load_state_dict(saved[name])
        self.saved_step = saved["progress"]["step"]

    def save(self, step: int) -> None:
        """Collective: each component's state (RNG states are gathered from every rank), written by rank 0.

        A step already saved (a preemption right after a periodic save) is not written again.
        """
        if step == self.saved_step:
            return
        self.saved_step = step
        state = {name: component.state_dict() for name, component in self.components.items()}
        state["run"] = self.run_record
        if self.dist.master:
            save_checkpoint(self.run_dir, step, state, self.keep)
        self.dist.barrier()


class Progress:
    """The run's position: optimizer steps taken."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
