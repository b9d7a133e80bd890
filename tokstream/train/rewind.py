"""Rewinding a run to an earlier checkpoint (resume_from=STEP; docs/loss-spikes.md): the checkpoints after it, and
metrics.jsonl as it was, are moved aside into run_dir/abandoned/, never deleted, and the run resumes from STEP.

The invariant: nothing is removed. A rewind moves later checkpoints (data file and manifest, each renamed whole; in S3
copied whole, and the originals deleted once every copy has their size) and copies metrics.jsonl into a folder of
its own, then points LATEST at STEP; the relaunch then trims metrics.jsonl to
STEP as any resume does. Every checkpoint the branch writes records resume_from in its config, so relaunching the
same command after a preemption goes on in the branch: a run rewinds only while a checkpoint newer than STEP was
written by another branch. A preemption notice during the moves waits for them (PreemptionWatch.whole); a rewind
killed mid-way is finished by the next launch (into a folder of its own), and one stopped after its moves is not
repeated (metrics.jsonl is already set aside, byte for byte).
"""

import os
import time
from pathlib import Path

from tokstream.errors import UserError
from tokstream.train.checkpoint_files import (HASH, Survey, checkpoint_name, manifest_name, mismatch, publish_pointer,
                                              read_manifest)
from tokstream.train.metrics import METRICS_FILE, parse_records
from tokstream.train.run_store import POINTER, LocalRunStore, RunStore

ABANDONED = "abandoned"


def rewind(store: RunStore, step: int, skips: list | None = None) -> str | None:
    """Move aside what the run wrote after checkpoint `step` unless it is this rewind's own branch (resumed at `step`
    with skip_steps `skips`); the line that says where, or None when there was nothing to move."""
    survey = Survey.of(store)
    if survey.complete and on_branch(store, survey.complete[-1], step, skips):
        return None  # the branch this rewind began goes on (its checkpoint at `step` may have been retired since)
    if step not in survey.complete:
        have = ", ".join(map(str, survey.complete)) or "none"
        raise UserError(f"resume_from={step}: the run has no complete checkpoint at step {step} (it has {have}); "
                        "give one of those steps (keep_checkpoints=0, or keep_every, keeps older ones)")
    later = sorted({s for s in survey.complete + survey.without_manifest + survey.stray_manifests if s > step})
    if not later:
        lines = store.read_bytes(METRICS_FILE) or b""  # read once, for both checks
        if not _lines_of_another_branch(lines, step, skips) or _already_set_aside(store, step, lines):
            return None
    problem = _target_problem(store, step)
    if problem is not None:
        raise UserError(f"resume_from={step}: the checkpoint at step {step} is damaged ({problem}); nothing was moved: "
                        "give another step")
    # Microseconds: a guard that rewinds by itself may rewind twice in a second; the names sort as they were made.
    now = time.time()
    stamp = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime(now))}{int(now % 1 * 1e6):06d}"
    folder = f"{ABANDONED}/after-{step:08d}-{stamp}-{os.getpid()}"
    # Data files before manifests: a move cut off leaves a manifest without data, never the reverse.
    moved = [name for later_step in later for name in (checkpoint_name(later_step), manifest_name(later_step))]
    store.set_aside([METRICS_FILE, POINTER], moved, folder)
    publish_pointer(store, step)
    where = f"{store.url.rstrip('/')}/{folder}" if not isinstance(store, LocalRunStore) else (
        store.root / folder if store.root.parent == Path(".") else (store.root / folder).relative_to(store.root.parent))
    if later:
        what = f"checkpoints {', '.join(map(str, later))} and metrics.jsonl as it was moved"
    else:
        what = "no checkpoint came after it; metrics.jsonl as it was (the steps after it) copied"
    return f"resume_from={step}: rewound; {what} to {where}"


def _lines_of_another_branch(lines: bytes, step: int, skips: list | None) -> bool:
    """Whether metrics.jsonl holds steps after `step` that another branch trained (a rewind to the newest checkpoint
    moves no checkpoint, but the relaunch cuts those lines): not when they begin with this branch's own relaunch."""
    records = [record for record in parse_records(lines, METRICS_FILE) if record["step"] > step]
    if not records:
        return False
    began = records[0].get("relaunch") or {}
    return began != {"from_step": step, "after": "rewind", "skip_steps": [list(pair) for pair in skips or []]}


def _already_set_aside(store: RunStore, step: int, lines: bytes) -> bool:
    """Whether metrics.jsonl, as it is now, is byte for byte the copy the newest rewind to `step` set aside: that
    rewind moved everything and was stopped before the relaunch trimmed the lines; nothing is left to keep."""
    folders = _abandoned_folders(store.url, step)
    if not folders:
        return False
    relative = f"{ABANDONED}/{folders[-1].rstrip('/').rsplit('/', 1)[-1]}/{METRICS_FILE}"
    return store.read_bytes(relative) == lines


def _target_problem(store: RunStore, step: int) -> str | None:
    """What is wrong with the checkpoint to rewind to, checked before anything moves: a local file against its
    manifest's size and hash; an object in S3 against the size (its hash is checked when it is loaded, as every
    checkpoint's is)."""
    manifest = read_manifest(store, step) or {"bytes": -1, HASH: ""}
    if isinstance(store, LocalRunStore):
        return mismatch(store.root / checkpoint_name(step), manifest)
    size = store.store.sizes().get(checkpoint_name(step))
    return None if size == manifest.get("bytes") else f"{size} bytes, its manifest says {manifest.get('bytes')}"


def rewind_target(store: RunStore, step: int, skips: list | None = None) -> dict | None:
    """When a rewind to `step` is due: {"run": the target's run record, "progress": {"step": step}}, so that the
    relaunch is checked against it before anything moves; None when no rewind is due (or it is refused: rewind()
    says why)."""
    survey = Survey.of(store)
    if step not in survey.complete or not [s for s in survey.complete + survey.without_manifest if s > step]:
        return None
    if on_branch(store, survey.complete[-1], step, skips):
        return None
    manifest = read_manifest(store, step) or {}
    if not isinstance(manifest.get("run"), dict):
        return None
    return {"run": manifest["run"], "progress": {"step": step}}


def on_branch(store: RunStore, newest: int, step: int, skips: list | None) -> bool:
    """Whether the newest checkpoint was written by a launch that rewound to `step` with these skips (its config
    says so; each of `skips` within one of its skips, which the guard's own rewinds may have joined into larger
    ones): a relaunch of that branch's command. New advice with the same resume_from adds a skip it does not hold."""
    manifest = read_manifest(store, newest) or {}
    config = (manifest.get("run") or {}).get("config") or {}
    held = [pair for pair in config.get("skip_steps") or [] if isinstance(pair, list) and len(pair) == 2]
    return config.get("resume_from") == step and all(
        any(first <= pair[0] and pair[1] <= last for first, last in held) for pair in skips or [])


def abandoned_records(run_dir: str, step: int) -> list[dict]:
    """The metrics.jsonl lines past `step` of the branch the newest rewind to `step` moved aside (train/plot.py draws
    them faded), from a local run_dir or one in S3; [] when there is none."""
    from tokstream.train.metrics import read_records

    folders = _abandoned_folders(run_dir, step)
    return [record for record in read_records(folders[-1]) if record["step"] > step] if folders else []


def _abandoned_folders(run_dir: str, step: int) -> list[str]:
    """The folders (paths, or URLs in S3) that rewinds to `step` set metrics.jsonl aside in, oldest first."""
    from tokstream.object_store import S3Dataset, is_s3

    start = f"after-{step:08d}-"
    if is_s3(run_dir):
        root = f"{run_dir.rstrip('/')}/{ABANDONED}"
        return sorted({f"{root}/{key.split('/')[0]}" for key in S3Dataset(root).keys()
                       if key.startswith(start) and key.endswith(f"/{METRICS_FILE}")})
    folder = Path(run_dir) / ABANDONED
    return sorted(str(path) for path in folder.glob(f"{start}*") if (path / METRICS_FILE).exists()) \
        if folder.is_dir() else []
