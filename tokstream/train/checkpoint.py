"""Checkpoints: assembled from the run's stateful components, written whole (in the background when
asked), published by the LATEST pointer written last, newest complete one found on relaunch, last K kept.

A checkpoint is a dict with one entry per component (`model`, `optimizer`, `loader`, `rng`,
`progress`: whatever has `state_dict()` / `load_state_dict()`) and `run`, the facts a relaunch is
checked against before anything is loaded (config, batch plan, dataset identity). Where the files
live, and why a cut-off save is never taken for a complete one: run_store.py.
"""

import json
import os
import pickle
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Protocol

import torch

from tokstream.errors import StoreError, UserError, no_space, out_of_space
from tokstream.train.distributed import Distributed
from tokstream.train.grace import state_bytes
from tokstream.train.metrics import METRICS_FILE
from tokstream.train.run_store import POINTER, LocalRunStore, RunStore, staging_path

CHECKPOINT_NAME = re.compile(r"^ckpt-(\d{8})\.pt$")


def checkpoint_name(step: int) -> str:
    return f"ckpt-{step:08d}.pt"


def latest_step(store: RunStore) -> int | None:
    """The step LATEST names (the newest complete checkpoint), None before the first save."""
    data = store.read_bytes(POINTER)
    if data is None:
        return None
    try:
        return int(json.loads(data)["step"])
    except (ValueError, KeyError, TypeError):
        raise UserError(f"{store.url}/{POINTER} is damaged ({data[:80]!r}): it names the newest complete checkpoint; "
                        "remove it and the run resumes from the newest checkpoint that loads") from None


def _steps(names: list[str]) -> list[int]:
    return sorted(int(m.group(1)) for m in map(CHECKPOINT_NAME.match, names) if m)


def checkpoints(store: RunStore) -> tuple[list[str], list[str]]:
    """(complete checkpoints oldest first, unpublished ones: newer than LATEST, from a cut-off save).

    Without LATEST, a local run directory's checkpoints all count (renamed into place whole, by a
    release before the pointer); in S3 none does (its first save never got as far as the pointer).
    """
    steps = _steps(store.names())
    newest = latest_step(store)
    if newest is None:
        newest = steps[-1] if steps and isinstance(store, LocalRunStore) else -1
    return ([checkpoint_name(s) for s in steps if s <= newest], [checkpoint_name(s) for s in steps if s > newest])


def write_checkpoint(store: RunStore, step: int, state: dict, keep: int, metrics: bytes | None = None) -> None:
    """Checkpoint, then the metrics (an S3 run's copy), then LATEST; then the oldest beyond `keep` go."""
    name = checkpoint_name(step)
    staged = staging_path(store, name)
    try:
        with open(staged, "wb") as handle:
            writes = _KeepingWriteErrors(handle)
            try:
                torch.save(state, writes)
            except RuntimeError:
                if writes.error is not None:
                    raise writes.error from None
                raise
            handle.flush()
            os.fsync(handle.fileno())
        store.publish(staged, name)
        if metrics is not None:
            store.publish_bytes(METRICS_FILE, metrics)
        store.publish_bytes(POINTER, json.dumps({"checkpoint": name, "step": step}).encode())
    finally:
        staged.unlink(missing_ok=True)
    complete = [checkpoint_name(s) for s in _steps(store.names()) if s <= step]  # LATEST names `step` now
    if keep > 0 and len(complete) > keep:
        store.remove(complete[:-keep])


class _KeepingWriteErrors:
    """The file torch.save writes a checkpoint through, keeping a failed write's OSError: torch's
    writer turns it into "unexpected pos 13293376 vs 13293268", which hides a full disk."""

    def __init__(self, handle):
        self.handle, self.error = handle, None

    def write(self, data) -> int:
        try:
            return self.handle.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def flush(self) -> None:
        self.handle.flush()


def load_latest_checkpoint(store: RunStore, dist: Distributed | None = None) -> tuple[str, dict] | tuple[None, None]:
    """The newest complete checkpoint that loads (its URL, its state); a damaged one falls back to
    the one before. Checkpoints that exist but none of which loads are refused: starting over from
    step 0 would silently throw the run away. With `dist`, every rank of the job calls this together."""
    complete, _ = checkpoints(store)
    failures = []
    for name in reversed(complete):
        url = f"{store.url}/{name}"
        path = _fetch_once_per_node(store, name, dist)
        try:
            # Data only: a checkpoint in shared storage must not be able to run code on the nodes
            # that resume from it, and this trainer writes nothing but tensors and plain values.
            return url, torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # truncated or corrupt file: say so and try the previous one
            if isinstance(err, pickle.UnpicklingError) and "Weights only load failed" in str(err):
                raise UserError(f"{url} holds objects other than tensors and plain values, which a checkpoint "
                                "of this trainer never does (or it is from a release before 2026-11-22): not "
                                "loaded; remove it to resume from the one before") from None
            print(f"warning: skipping unreadable checkpoint {url}: {type(err).__name__}: {err}")
            failures.append(name)
        finally:
            _release_once_per_node(store, path, dist)
    if failures:
        raise UserError(f"none of the {len(failures)} checkpoints in {store.url} can be read (newest: {failures[0]}): "
                        "move them away to start the run over, or point run_dir at a copy that reads")
    return None, None


def _shares_a_copy(store: RunStore, dist: Distributed | None) -> bool:
    return dist is not None and dist.enabled and not isinstance(store, LocalRunStore)


def _fetch_once_per_node(store: RunStore, name: str, dist: Distributed | None) -> Path:
    """The checkpoint as a local file. From S3, the node's first rank downloads it and the others
    read its copy: 8 ranks would otherwise each fetch the same gigabytes at every resume. A failed
    download fails every rank with its message (they wait for it in one gather)."""
    if not _shares_a_copy(store, dist):
        return store.local_copy(name)
    owner, error = f"node{dist.node}", None
    if dist.local_rank == 0:
        try:
            store.local_copy(name, owner)
        except UserError as err:
            error = str(err)
    errors = [e for e in dist.gather(error) if e]
    if errors:
        raise UserError(errors[0])
    return store.copy_path(name, owner)


def _release_once_per_node(store: RunStore, path: Path, dist: Distributed | None) -> None:
    if not _shares_a_copy(store, dist):
        store.release_copy(path)
        return
    dist.barrier()  # every rank of the node has read it
    if dist.local_rank == 0:
        store.release_copy(path)


def remove_unfinished_saves(store: RunStore) -> list[str]:
    """What saves that a kill cut off left: staging files, and checkpoints LATEST never named (a
    run_dir belongs to one job at a time)."""
    staged = sorted(store.local.glob("*.tmp*")) if store.local.is_dir() else []
    for path in staged:
        path.unlink(missing_ok=True)
    _, unpublished = checkpoints(store)
    store.remove(unpublished)
    return [p.name for p in staged] + unpublished


def find_latest(store: RunStore, dist: Distributed | None = None) -> tuple[str, dict] | tuple[None, None]:
    """The newest complete checkpoint of a run, as written (nothing is restored yet); `dist`: as
    load_latest_checkpoint."""
    url, saved = load_latest_checkpoint(store, dist)
    if saved is not None and "progress" not in saved:
        raise UserError(f"{url} was written before checkpoints were assembled from components (tokstream "
                        "before the tokstream.train package): resume it with that release, or use a new run_dir")
    return url, saved


class Stateful(Protocol):
    def state_dict(self) -> object: ...

    def load_state_dict(self, state) -> None: ...


class HostSnapshot:
    """Copies of a state's tensors in host memory that training can no longer change: what a
    background save writes. The buffers are allocated (pinned, for GPU tensors) at the first
    snapshot and reused: a fresh 1.5 GB allocation costs more in page faults than the copy itself."""

    def __init__(self) -> None:
        self.buffers: dict[tuple, torch.Tensor] = {}
        self._taken: dict[tuple, torch.Tensor] = {}  # in one snapshot: a tensor reached twice (tied weights) is copied once

    def take(self, state: object) -> object:
        self._taken = {}
        snapshot = self._copy(state, ())
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the device-to-host copies were queued without blocking
        return snapshot

    def _copy(self, value: object, where: tuple) -> object:
        if isinstance(value, torch.Tensor):
            identity = (value.device, value.data_ptr(), value.shape, value.dtype, value.stride())
            if identity in self._taken:
                return self._taken[identity]
            buffer = self.buffers.get(where)
            if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
                buffer = torch.empty(value.shape, dtype=value.dtype, pin_memory=value.is_cuda)
                self.buffers[where] = buffer
            self._taken[identity] = buffer.copy_(value.detach(), non_blocking=value.is_cuda)
            return buffer
        if isinstance(value, dict):
            return {key: self._copy(item, (*where, key)) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._copy(item, (*where, index)) for index, item in enumerate(value))
        return value


class Checkpointer:
    """Saves and restores a run's components in its store; rank 0 writes, every rank takes part.

    `save(step, background=True)` (periodic saves) takes a snapshot at the step boundary and writes
    it on a thread while training goes on, at most one in flight; a failed background save is a
    warning and the previous checkpoint stays the newest. `save(step)` (preemption, end of the run)
    waits for the one in flight, writes, and raises if it cannot.
    """

    def __init__(self, store: RunStore, keep: int, dist: Distributed, components: dict[str, Stateful],
                 run_record: dict, metrics_path: Path | None = None):
        self.store, self.keep, self.dist = store, keep, dist
        self.components, self.run_record = components, run_record
        self.metrics_path = metrics_path  # an S3 run's local metrics, uploaded with each checkpoint
        self.saved_step: int | None = None  # the step the newest complete checkpoint holds (rank 0)
        self.snapshot_step: int | None = None  # the newest step whose state was taken (every rank)
        self.write_s = 0.0  # how long the last save took to write
        self._in_flight: threading.Thread | None = None
        self._snapshot = HostSnapshot()
        if dist.master:
            for name in remove_unfinished_saves(store):
                print(f"removed {name}, a save that was interrupted")
        dist.barrier()

    def restore(self, saved: dict) -> None:
        for name, component in self.components.items():
            component.load_state_dict(saved[name])
        self.saved_step = self.snapshot_step = saved["progress"]["step"]

    def save(self, step: int, background: bool = False) -> None:
        """Collective (RNG states are gathered from every rank); a step already saved is not saved again."""
        if not background:
            self.wait()
            done = self.dist.gather(self.saved_step)[0] == step  # rank 0 knows whether it was written
            if done:
                return
        elif step == self.snapshot_step:
            return
        self.snapshot_step = step
        state = {name: component.state_dict() for name, component in self.components.items()}
        state["run"] = self.run_record
        if self.dist.master:
            metrics = self.metrics_path.read_bytes() if self.metrics_path and self.metrics_path.exists() else None
            if background:
                self.wait()  # at most one in flight, and its buffers are free again
                snapshot = self._snapshot.take(state)
                self._in_flight = threading.Thread(target=self._write_in_background, args=(step, snapshot, metrics),
                                                   name=f"checkpoint-{step}", daemon=False)
                self._in_flight.start()
            else:
                failure = self._write(step, state, metrics)
        if not background:
            # In place of a barrier (no rank may exit, ending the job, before rank 0 has written): every
            # rank learns whether it did, and a failed final save ends them all with rank 0's one line.
            failure = self.dist.gather(failure if self.dist.master else None)[0]
            if failure is not None:
                raise StoreError(f"checkpoint at step {step} not saved: {failure}")

    def _write(self, step: int, state: dict, metrics: bytes | None) -> str | None:
        """Write the checkpoint; why it failed, or None."""
        began = time.perf_counter()
        try:
            write_checkpoint(self.store, step, state, self.keep, metrics)
        except (OSError, RuntimeError, StoreError) as err:  # disk full, store unreachable, torch.save's writer
            if not out_of_space(err):
                return str(err)
            free = shutil.disk_usage(self.store.local).free
            return (f"{no_space(self.store.local, err)}: the checkpoint takes {state_bytes(state) / 2**20:.1f} MiB, "
                    f"{free / 2**20:.1f} MiB is free there; free space or give that directory a bigger disk (run_dir; "
                    "run_local for a run in S3)")
        self.saved_step = step
        self.write_s = time.perf_counter() - began
        return None

    def _write_in_background(self, step: int, state: dict, metrics: bytes | None) -> None:
        failure = self._write(step, state, metrics)
        if failure is not None:
            newest = f"step {self.saved_step}" if self.saved_step is not None else "none"
            print(f"warning: checkpoint at step {step} not saved ({failure}); the newest checkpoint is still "
                  f"{newest}; training goes on", flush=True)

    @property
    def in_flight(self) -> bool:
        """A background save is still being written."""
        return self._in_flight is not None and self._in_flight.is_alive()

    def wait(self) -> None:
        """Until the save in flight (if any) has finished."""
        if self._in_flight is not None:
            self._in_flight.join()
            self._in_flight = None


class Progress:
    """The run's position: optimizer steps taken."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
