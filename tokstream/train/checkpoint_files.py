"""A checkpoint in a run's store: `ckpt-XXXXXXXX.pt` and its manifest `ckpt-XXXXXXXX.manifest.json`.

The invariant: a checkpoint is complete when its manifest exists and its data file has the size and
the xxh3-128 checksum the manifest records. The manifest is written after the data (both whole or
not at all: run_store.py), so a save cut off at any point leaves no manifest. Checksums are checked
before a checkpoint is loaded (checkpoint.py); `LATEST`, written last, only tells people and tools
which save is the newest: a relaunch takes it as a hint.

Deletion is proven, never inferred. Only these are ever removed:
- retention: a complete checkpoint whose manifest carries this run's id, once `keep` newer checkpoints
  the job trusts (the one it resumed from, verified, and those it wrote) exist, unless its step is a multiple
  of keep_every;
- a file staged under a save's own names (STAGING_NAME: `ckpt-XXXXXXXX.pt.tmpPID` and the like for
  the manifest, LATEST, LEASE, metrics.jsonl and the write probe; never a complete file), by the
  next launch holding the run's lease, so no live job is writing it;
- a manifest of this run whose data file retention already removed (a removal cut off between the two);
- LEASE, by the job holding it (run_lease.py).
A data file without a manifest (a save cut off before its manifest, or one written before manifests
existed) is never removed and never resumed from (train/vouch.py writes a manifest on a person's
word); saving that step again replaces it. A relaunch also trims metrics.jsonl to the step it resumes from.

A manifest also carries the run's record (its config and data identities, as in the checkpoint), so a tool that
needs no weights (train/ledger.py) reads a few kilobytes, not the checkpoint: gigabytes, from S3.
"""

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import xxhash

from tokstream.train.metrics import METRICS_FILE
from tokstream.train.run_store import POINTER, RunStore, staging_path

CHECKPOINT_NAME = re.compile(r"^ckpt-(\d{8})\.pt$")
MANIFEST_NAME = re.compile(r"^ckpt-(\d{8})\.manifest\.json$")
STAGING_NAME = re.compile(r"^(ckpt-\d{8}\.pt|ckpt-\d{8}\.manifest\.json|LATEST|LEASE|metrics\.jsonl|\.write-probe)"
                          r"\.tmp\d+$")
HASH = "xxh3_128"
READ_CHUNK = 8 << 20


def checkpoint_name(step: int) -> str:
    return f"ckpt-{step:08d}.pt"


def manifest_name(step: int) -> str:
    return f"ckpt-{step:08d}.manifest.json"


def _steps(names: list[str], pattern: re.Pattern) -> list[int]:
    return sorted(int(m.group(1)) for m in map(pattern.match, names) if m)


@dataclass(frozen=True)
class Survey:
    """What a run's store holds, from one listing: nothing is read or verified yet."""

    complete: list[int]  # steps with a data file and a manifest, oldest first (still to be verified)
    without_manifest: list[int]  # data files no manifest vouches for
    stray_manifests: list[int]  # manifests whose data file is gone

    @classmethod
    def of(cls, store: RunStore) -> "Survey":
        names = store.names()
        data, manifests = set(_steps(names, CHECKPOINT_NAME)), set(_steps(names, MANIFEST_NAME))
        return cls(sorted(data & manifests), sorted(data - manifests), sorted(manifests - data))


def latest_step(store: RunStore) -> int | None:
    """The newest step with a manifest (not yet verified), None before the first complete save."""
    complete = Survey.of(store).complete
    return complete[-1] if complete else None


def pointer_step(store: RunStore) -> tuple[int | None, str | None]:
    """(the step LATEST names, or None; what is wrong with LATEST, or None)."""
    data = store.read_bytes(POINTER)
    if data is None:
        return None, "missing"
    try:
        step = json.loads(data)["step"]
    except (ValueError, KeyError, TypeError):
        step = None
    # A step is a whole number: JSON also reads 1e999 (infinity, which int() cannot take), 12.5 or true.
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return None, f"damaged ({data[:40]!r})"
    return step, None


def publish_pointer(store: RunStore, step: int, stopped_by: str | None = None) -> None:
    """Point LATEST at checkpoint `step`; with `stopped_by`, say why the run stopped there (a notice on a step a
    periodic save had already written: the relaunch's record then says it too)."""
    pointer = {"checkpoint": checkpoint_name(step), "step": step, **({"stopped_by": stopped_by} if stopped_by else {})}
    store.publish_bytes(POINTER, json.dumps(pointer).encode())


def stopped_by(store: RunStore, step: int) -> str | None:
    """Why the run stopped at `step`, where LATEST says it (publish_pointer); None otherwise."""
    try:
        said = json.loads(store.read_bytes(POINTER) or b"{}")
    except ValueError:
        return None
    return said.get("stopped_by") if isinstance(said, dict) and said.get("step") == step else None


def read_manifest(store: RunStore, step: int) -> dict | None:
    """The manifest of `step`, None when it is not one (unreadable JSON or fields missing)."""
    data = store.read_bytes(manifest_name(step))
    try:
        manifest = json.loads(data) if data is not None else None
        if manifest["step"] == step and isinstance(manifest["bytes"], int) and isinstance(manifest[HASH], str):
            return manifest
    except (ValueError, KeyError, TypeError):
        pass
    return None


def file_digest(path: Path) -> str:
    return file_bytes_and_digest(path)[1]


def file_bytes_and_digest(path: Path) -> tuple[int, str]:
    digest, size = xxhash.xxh3_128(), 0
    with open(path, "rb") as handle:
        while chunk := handle.read(READ_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def mismatch(path: Path, manifest: dict) -> str | None:
    """Why the file at `path` is not the checkpoint `manifest` describes, or None when it is."""
    size = path.stat().st_size
    if size != manifest["bytes"]:
        return f"{size} bytes where its manifest records {manifest['bytes']}"
    if file_digest(path) != manifest[HASH]:
        return f"its {HASH} checksum differs from its manifest's"
    return None


def write_manifest(store: RunStore, step: int, size_and_digest: tuple[int, str], run_id: str,
                   run: dict | None = None) -> None:
    manifest = {"checkpoint": checkpoint_name(step), "step": step, "bytes": size_and_digest[0],
                HASH: size_and_digest[1], "run_id": run_id}
    if run is not None:
        manifest["run"] = run
    store.publish_bytes(manifest_name(step), json.dumps(manifest).encode())


class _DigestingWriter:
    """The file torch.save writes through: checksums the bytes on their way out (no second read), and
    keeps a failed write's OSError, which torch's writer turns into "unexpected pos ..." (hiding a full disk)."""

    def __init__(self, handle):
        self.handle, self.error = handle, None
        self.digest, self.bytes = xxhash.xxh3_128(), 0

    def write(self, data) -> int:
        try:
            written = self.handle.write(data)
        except OSError as err:
            self.error = self.error or err
            raise
        self.digest.update(data)
        self.bytes += written
        return written

    def flush(self) -> None:
        self.handle.flush()


def write_checkpoint(store: RunStore, step: int, state: dict, keep: int, run_id: str, trusted: list[int],
                     metrics: bytes | None = None, keep_every: int = 0) -> None:
    """Data, the metrics (an S3 run's copy), manifest, LATEST; then retention, counting the `trusted`
    steps (the writer's own saves and the one it resumed from, verified) and `step`. Raises what a write raised.
    The metrics before the manifest: the manifest makes the checkpoint one a relaunch resumes from, with the
    store's metrics as they are then (a copy newer than the checkpoint is cut back to its step)."""
    import torch  # here: what reads a run without writing it (train/plot.py, the ledger's survey) skips its 1.3 s

    name = checkpoint_name(step)
    staged = staging_path(store, name)
    try:
        with open(staged, "wb") as handle:
            writer = _DigestingWriter(handle)
            try:
                torch.save(state, writer)
            except RuntimeError:
                if writer.error is not None:
                    raise writer.error from None
                raise
            handle.flush()
            os.fsync(handle.fileno())
        store.publish(staged, name)
    finally:
        staged.unlink(missing_ok=True)
    if metrics is not None:
        store.publish_bytes(METRICS_FILE, metrics)
    write_manifest(store, step, (writer.bytes, writer.digest.hexdigest()), run_id, state.get("run"))
    publish_pointer(store, step)
    remove_beyond_keep(store, keep, run_id, [*trusted, step], keep_every)


def remove_beyond_keep(store: RunStore, keep: int, run_id: str, trusted: list[int], keep_every: int = 0) -> None:
    """Retention: this run's checkpoints older than the `keep` newest `trusted` ones, but those at a multiple of
    `keep_every` (rewind targets). Only trusted ones count: a damaged checkpoint left where it was must not push good
    ones out. Data first, so a removal cut off leaves a manifest without data, never data without a manifest."""
    trusted = sorted(set(trusted))
    if keep <= 0 or len(trusted) < keep:
        return
    oldest_kept = trusted[-keep]
    survey = Survey.of(store)

    def ours(step: int) -> bool:
        return (read_manifest(store, step) or {}).get("run_id") == run_id

    def kept_every(step: int) -> bool:
        return bool(keep_every) and step % keep_every == 0

    doomed = [step for step in survey.complete if step < oldest_kept and not kept_every(step) and ours(step)]
    strays = [step for step in survey.stray_manifests if step < oldest_kept and ours(step)]
    if doomed:
        store.remove([checkpoint_name(step) for step in doomed])
    if doomed or strays:
        store.remove([manifest_name(step) for step in doomed + strays])


def remove_staging_files(store: RunStore) -> list[str]:
    """Staging files a killed save left in the run's local directory (names only a save writes)."""
    if not store.local.is_dir():
        return []
    staged = sorted(path for path in store.local.iterdir() if STAGING_NAME.match(path.name) and path.is_file())
    for path in staged:
        path.unlink(missing_ok=True)
    return [path.name for path in staged]
