"""What a relaunch may change in a run's config (the README's resume table is this module).

- Free: how the run executes, not what it computes: world size (not a setting), micro-batch (the
  sample schedule does not depend on it: BatchPlan.epoch_samples), workers, caches, where the data
  lives and what a source is called (the data's identity is checked: Dataset.check_resumes (tokstream.reader)),
  logging, evaluation, checkpoint cadence, compilation, max_steps while the LR schedule stays put.
- Fixed: what the checkpoint or the sample order is made of, a mixture's sources and weights
  included. Changing it needs a new run_dir.
- The recipe: everything else (seed, dtype, optim.*, a max_steps that moves the LR schedule).
  Refused with the setting named, unless the relaunch lists it in `resume_allow` on purpose.
"""

from fnmatch import fnmatch

from tokstream.errors import UserError
from tokstream.train.config import TrainConfig

FREE = ("run_dir", "run_local", "log_interval", "eval_interval", "eval_batches", "checkpoint_interval",
        "keep_checkpoints", "background_checkpoints", "preempt_grace_s", "lease_interval_s", "trace_samples",
        "device", "compile", "deterministic", "micro_batch_size",
        "data.remote", "data.local", "data.val_split", "data.num_workers", "data.prefetch_factor",
        "data.predownload", "data.cache_limit", "data.validate_hash", "data.download_retry",
        "data.clean_stale_shared_memory", "data.streams.*.remote", "data.streams.*.local", "data.streams.*.name")
FIXED = {
    "model.*": "the checkpoint's weights have the saved architecture",
    "global_batch_size": "each step's samples and the LR schedule's steps depend on it",
    "data.split": "the sample order would change",
    "data.shuffle_*": "the sample order would change",
    "data.num_canonical_nodes": "the sample order would change",
    "data.streams.*": "the mixture, and so the sample order, would change",
}


def _flatten(config: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in config.items():
        if isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
            value = {str(index): item for index, item in enumerate(value)}  # data.streams.N.key
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _decay_steps(config: dict) -> int:
    """The cosine's length: optim.decay_steps, or max_steps when that is unset."""
    return config["optim"]["decay_steps"] or config["max_steps"]


def check_relaunch(saved: dict, config: TrainConfig) -> list[str]:
    """Refuse (UserError) a change the policy does not allow; return one line per accepted change."""
    now = config.to_dict()
    sources_then, sources_now = len(saved["data"].get("streams", [])), len(now["data"]["streams"])
    if sources_then != sources_now:
        describe = lambda count: f"a mixture of {count}" if count else "one dataset (data.remote)"  # noqa: E731
        raise UserError(f"data.streams: the checkpoint's run read {describe(sources_then)}, this launch "
                        f"{describe(sources_now)}: {FIXED['data.streams.*']}; keep it, or use a new run_dir")
    old_flat, new_flat = _flatten(saved), _flatten(now)
    changed = [key for key in new_flat if key in old_flat and old_flat[key] != new_flat[key] and key != "resume_allow"]
    schedule_holds = _decay_steps(saved) == _decay_steps(now)
    notes = []
    for key in changed:
        change = f"{key} changed from {old_flat[key]!r} to {new_flat[key]!r}"
        free = any(fnmatch(key, pattern) for pattern in FREE)
        reason = None if free else next((why for pattern, why in FIXED.items() if fnmatch(key, pattern)), None)
        if reason:
            raise UserError(f"{change} since the checkpoint: {reason}; keep it, or use a new run_dir")
        if free or (key == "optim.decay_steps" and schedule_holds) or (
                key == "max_steps" and (schedule_holds or now["optim"]["decay_steps"])):
            notes.append(change)
        elif key in config.resume_allow:
            notes.append(f"{change} (resume_allow: on purpose)")
        elif key == "max_steps":
            raise UserError(f"{change} while optim.decay_steps is unset: the learning-rate schedule would move; "
                            f"set optim.decay_steps={_decay_steps(saved)} to keep it, or add resume_allow=[max_steps] "
                            "to change it on purpose")
        else:
            raise UserError(f"{change} since the checkpoint: a resumed run keeps its recipe; use a new run_dir, or "
                            f"add resume_allow=[{key}] to change it on purpose")
    return notes
