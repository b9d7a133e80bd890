"""Checkpoints: assembled from the run's stateful components, written whole (in the background when
asked) with a manifest of their size and checksum, verified before they are loaded, the newest that
passes its checks found on relaunch, last K kept.

A checkpoint is a dict with one entry per component (`model`, `optimizer`, `loader`, `rng`,
`progress`: whatever has `state_dict()` / `load_state_dict()`) and `run`, the facts a relaunch is
checked against before anything is loaded (config, batch plan, dataset identity, the run's id).
What makes one complete and what may ever be deleted: checkpoint_files.py; where the files live:
run_store.py.
"""

import contextlib
import pickle
import shutil
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Protocol

import torch

from tokstream.errors import StoreError, UserError, no_space, out_of_space
from tokstream.train.checkpoint_files import (Survey, checkpoint_name, file_bytes_and_digest, mismatch, pointer_step,
                                              read_manifest, remove_staging_files, write_checkpoint, write_manifest)
from tokstream.train.distributed import Distributed
from tokstream.train.grace import state_bytes
from tokstream.train.run_store import LocalRunStore, RunStore

START_AFRESH = "nothing was deleted; to start the run afresh, point run_dir at a new directory"


def find_latest(store: RunStore, dist: Distributed | None = None) -> tuple[str, dict] | tuple[None, None]:
    """The newest checkpoint of a run that passes its checks, as written (nothing is restored yet);
    (None, None) for a run with no checkpoint at all. One that fails its checks falls back to the one
    before, with a warning; checkpoints none of which can be used are refused, never taken for a
    fresh start. With `dist`, every rank of the job calls this together, and rank 0 speaks."""
    survey = Survey.of(store)
    say = print if dist is None or dist.master else _silent
    unusable = [f"{checkpoint_name(step)} (no manifest)" for step in survey.without_manifest]
    for index, step in enumerate(reversed(survey.complete)):
        url, saved, problem = _load_verified(store, step, dist)
        if saved is not None:
            break
        after = "falling back to the checkpoint before it" if index + 1 < len(survey.complete) else "none is older"
        say(f"warning: {url} not used: {problem}; {after}", flush=True)
        unusable.insert(0, f"{checkpoint_name(step)} ({problem})")
    else:
        _refuse_a_fresh_start_over_a_lost_run(store, survey, unusable)
        return None, None
    if "progress" not in saved:
        raise UserError(f"{url} was written before checkpoints were assembled from components (tokstream "
                        "before the tokstream.train package): resume it with that release, or use a new run_dir")
    for line in _hint_lines(store, step, survey):
        say(line)
    return url, saved


def newest_run_record(store: RunStore) -> tuple[int, dict] | tuple[None, None]:
    """(step, run record: config, data identities) of the checkpoint a relaunch would resume from (find_latest:
    the newest that passes its checks). Where LATEST names the newest complete checkpoint, from its manifest
    (a few kilobytes; manifests carry the record since 2026-11-25); else, after a relaunch fell back past a
    damaged checkpoint or a kill came between a save and LATEST, by find_latest's own checks (the checkpoint
    is read). (None, None) for a run with no checkpoint."""
    complete = Survey.of(store).complete
    step, _ = pointer_step(store)
    if complete and step == complete[-1]:
        manifest = read_manifest(store, step)
        if manifest is not None and isinstance(manifest.get("run"), dict):
            return step, manifest["run"]
    with contextlib.redirect_stdout(sys.stderr):  # its warnings: a reader's stdout is its answer (ledger --json)
        _, saved = find_latest(store)
    return (None, None) if saved is None else (saved["progress"]["step"], saved["run"])


def _silent(*args, **kwargs) -> None:
    pass


def _refuse_a_fresh_start_over_a_lost_run(store: RunStore, survey: Survey, unusable: list[str]) -> None:
    """A run_dir with no usable checkpoint starts afresh only if nothing shows that a run saved there:
    checkpoint files, manifests whose files are gone (a copy that left out *.pt, a lifecycle rule) or
    LATEST. Starting over would train from step 0 and overwrite the run's metrics."""
    if unusable:
        why = ("(a checkpoint without a manifest is a save cut off before it finished, or one written by tokstream "
               "before 2026-11-24: python train/vouch.py RUN_DIR writes manifests for those you vouch for); "
               if survey.without_manifest else "")
        raise UserError(f"{store.url} holds checkpoints none of which can be resumed from: {', '.join(unusable)}; "
                        f"{why}{START_AFRESH}")
    gone = [checkpoint_name(step) for step in survey.stray_manifests]
    pointer, problem = pointer_step(store)
    if gone or problem != "missing":
        named = ", ".join(gone) if gone else f"LATEST names {checkpoint_name(pointer) if pointer else 'a checkpoint'}"
        raise UserError(f"the checkpoints of the run in {store.url} are gone ({named}, but no checkpoint file is "
                        f"there): restore them; {START_AFRESH}")


def _hint_lines(store: RunStore, step: int, survey: Survey) -> list[str]:
    """What a relaunch should tell about LATEST and newer files when it resumes from `step`."""
    lines, name = [], checkpoint_name(step)
    pointer, problem = pointer_step(store)
    if problem:
        lines.append(f"LATEST in {store.url} is {problem}: resuming from the newest checkpoint that passes its "
                     f"checks, {name}")
    elif pointer != step:
        what = "an older checkpoint" if pointer < step else "a checkpoint that is missing or failed its checks"
        lines.append(f"LATEST names {checkpoint_name(pointer)}, {what}: resuming from the newest checkpoint that "
                     f"passes its checks, {name}")
    newer = [checkpoint_name(s) for s in survey.without_manifest if s > step]
    if newer:
        lines.append(f"not resumed from (no manifest: a save cut off before it finished; kept, and replaced when "
                     f"the run saves that step again): {', '.join(newer)}")
    return lines


def _load_verified(store: RunStore, step: int, dist: Distributed | None) -> tuple[str, dict | None, str | None]:
    """(url, the state or None, why not). The file is checked against its manifest once per node (by
    its first rank, which also downloads it from S3), then loaded by every rank; every rank reaches
    the same verdict."""
    name = checkpoint_name(step)
    url = f"{store.url}/{name}"
    path = _fetch_once_per_node(store, name, dist)
    try:
        problem = None
        if dist is None or not dist.enabled or dist.local_rank == 0:
            manifest = read_manifest(store, step)
            problem = "its manifest is unreadable" if manifest is None else mismatch(path, manifest)
        problem = _first(problem, dist)
        if problem is not None:
            return url, None, problem
        saved = None
        try:
            # Data only: a checkpoint in shared storage must not be able to run code on the nodes
            # that resume from it, and this trainer writes nothing but tensors and plain values.
            saved = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:
            if isinstance(err, pickle.UnpicklingError) and "Weights only load failed" in str(err):
                raise UserError(f"{url} holds objects other than tensors and plain values, which a checkpoint "
                                "of this trainer never does: not loaded; move it away to resume from the one "
                                "before") from None
            problem = f"unreadable ({type(err).__name__}: {err})"
        problem = _first(problem, dist)
        return url, saved if problem is None else None, problem
    finally:
        _release_once_per_node(store, path, dist)


def _first(problem: str | None, dist: Distributed | None) -> str | None:
    """The first rank's problem, if any rank has one: the ranks go on or fall back together."""
    if dist is None or not dist.enabled:
        return problem
    return next((p for p in dist.gather(problem) if p is not None), None)


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


def vouch_for(store: RunStore, steps: list[int] | None = None) -> list[str]:
    """Write manifests for checkpoint files that have none (`steps`, default all), on a person's word:
    a release before manifests wrote them, or a save was cut off between its file and its manifest.
    Each must load as this trainer's checkpoint of the step its name says; returns a line per file."""
    survey = Survey.of(store)
    chosen = survey.without_manifest if steps is None else steps
    lines = []
    for step in chosen:
        name = checkpoint_name(step)
        if step not in survey.without_manifest:
            raise UserError(f"{store.url}/{name}: " + ("it has a manifest already" if step in survey.complete
                                                      else "no such checkpoint file"))
        path = store.local_copy(name)
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
            if saved.get("progress", {}).get("step") != step:
                raise ValueError(f"it holds no trainer state of step {step}")
            run = saved.get("run") if isinstance(saved.get("run"), dict) else None
            write_manifest(store, step, file_bytes_and_digest(path), (run or {}).get("run_id")
                           or f"vouched-{new_run_id()}", run)
        except Exception as err:
            raise UserError(f"{store.url}/{name} cannot be vouched for: {type(err).__name__}: {err}; nothing "
                            "was written") from None
        finally:
            store.release_copy(path)
        lines.append(f"{store.url}/{name}: manifest written (step {step})")
    return lines


def new_run_id() -> str:
    """The id a run's manifests carry: retention removes only checkpoints with its own."""
    return uuid.uuid4().hex


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
                 run_record: dict, metrics_path: Path | None = None, interval: int | None = None,
                 last_step: int | None = None, background: bool = True, keep_every: int = 0):
        self.store, self.keep, self.keep_every, self.dist = store, keep, keep_every, dist
        # The cadence (after_step): every `interval` steps, in the background if `background`; at `last_step`, waited for.
        self.interval, self.last_step, self.background = interval, last_step, background
        self.components = components
        self.run_record = {**run_record, "run_id": run_record.get("run_id") or new_run_id()}
        self.metrics_path = metrics_path  # an S3 run's local metrics, uploaded with each checkpoint
        self.saved_step: int | None = None  # the step the newest complete checkpoint holds (rank 0)
        self.snapshot_step: int | None = None  # the newest step whose state was taken (every rank)
        self.write_s = 0.0  # how long the last save took to write
        self._in_flight: threading.Thread | None = None
        self._snapshot = HostSnapshot()
        self._trusted: list[int] = []  # steps known whole: resumed from (verified) or written by this job (rank 0)
        if dist.master:  # the job holds the run's lease: no other job is writing these
            for name in remove_staging_files(store):
                print(f"removed {name}, a save that was interrupted")
        dist.barrier()

    def restore(self, saved: dict) -> None:
        """Load every component; the run keeps the id its checkpoints carry (none before 2026-11-24)."""
        self.run_record["run_id"] = saved["run"].get("run_id") or self.run_record["run_id"]
        for name, component in self.components.items():
            if name not in saved and getattr(component, "optional_in_checkpoints", False):
                continue  # a checkpoint from before the component existed
            component.load_state_dict(saved[name])
        self.saved_step = self.snapshot_step = saved["progress"]["step"]
        self._trusted.append(self.saved_step)

    def after_step(self, step: int) -> None:
        """The run's cadence, after step `step` is trained: the last step's save is waited for; a periodic one is
        written while training goes on (with background checkpoints)."""
        if step == self.last_step:
            self.save(step)
        elif self.interval and step % self.interval == 0:
            self.save(step, background=self.background)

    def save(self, step: int, background: bool = False) -> bool:
        """Collective (RNG states are gathered from every rank); a step already saved is not saved again (False)."""
        if not background:
            self.wait()
            done = self.dist.gather(self.saved_step)[0] == step  # rank 0 knows whether it was written
            if done:
                return False
        elif step == self.snapshot_step:
            return False
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
        return True

    def _write(self, step: int, state: dict, metrics: bytes | None) -> str | None:
        """Write the checkpoint; why it failed, or None."""
        began = time.perf_counter()
        try:
            write_checkpoint(self.store, step, state, self.keep, self.run_record["run_id"], self._trusted, metrics,
                             self.keep_every)
        except (OSError, RuntimeError, StoreError) as err:  # disk full, store unreachable, torch.save's writer
            if not out_of_space(err):
                return str(err)
            free = shutil.disk_usage(self.store.local).free
            return (f"{no_space(self.store.local, err)}: the checkpoint takes {state_bytes(state) / 2**20:.1f} MiB, "
                    f"{free / 2**20:.1f} MiB is free there; free space or give that directory a bigger disk (run_dir; "
                    "run_local for a run in S3)")
        self.saved_step = step
        self._trusted.append(step)
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
    """The run's position: optimizer steps taken; and, in a checkpoint that ended a launch on a preemption notice,
    that it did (the relaunch's first line in metrics.jsonl says so, and train/plot.py marks it)."""

    def __init__(self) -> None:
        self.step = 0
        self.stopped_by: str | None = None

    def state_dict(self) -> dict:
        return {"step": self.step, **({"stopped_by": self.stopped_by} if self.stopped_by else {})}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        self.stopped_by = state.get("stopped_by")
