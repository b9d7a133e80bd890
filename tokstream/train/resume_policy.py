"""What a relaunch may change in a run's config (the README's resume table is this module).

- Free: how the run executes, not what it computes: world size (not a setting), micro-batch (the
  sample schedule does not depend on it: BatchPlan.epoch_samples), workers, caches, where the data
  lives and what a source is called (the data's identity is checked: Dataset.check_resumes (tokstream.reader)),
  logging, evaluation, checkpoint cadence, compilation, max_steps while the LR schedule stays put.
- Fixed: what the checkpoint or the sample order is made of, a mixture's sources and weights
  included. Changing it needs a new run_dir.
- Phases (phases.py): a phase that has started or ended keeps its recipe (start, global batch, data);
  phases that start after the checkpoint's step may be edited, added or removed, said in one line.
- The recipe: everything else (seed, dtype, optim.*, a max_steps that moves the LR schedule).
  Refused with the setting named, unless the relaunch lists it in `resume_allow` on purpose.
"""

import dataclasses
from fnmatch import fnmatch

from tokstream.errors import UserError
from tokstream.reader import AUTO_SHUFFLE
from tokstream.train.config import TrainConfig, config_from_dict
from tokstream.train.phases import Phase, read_through, resolve_phases, started

FREE = ("run_dir", "run_local", "log_interval", "eval_interval", "eval_batches", "checkpoint_interval",
        "keep_checkpoints", "keep_every", "resume_from", "guard.rewind", "guard.skip", "guard.max_rewinds", "guard.rewinds_done*", "background_checkpoints", "preempt_grace_s", "lease_interval_s", "trace_samples",
        "device", "compile", "deterministic", "micro_batch_size", "log.*",
        "data.remote", "data.local", "data.val_split", "data.num_workers", "data.prefetch_factor",
        "data.predownload", "data.cache_limit", "data.validate_hash", "data.download_retry",
        "data.clean_stale_shared_memory", "data.max_documents", "data.order_dir", "data.streams.*.remote", "data.streams.*.local", "data.streams.*.name")
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


# With phases, what each phase reads is compared phase by phase (check_phases), not as the run's settings.
PHASE_SETTINGS = ("phases.*", "global_batch_size", "data.remote", "data.local", "data.split", "data.val_split",
                  "data.streams.*")


def keep_run_order(config: TrainConfig, saved: dict) -> TrainConfig:
    """`config` in the order the run with the recorded config `saved` was read in: its own data.shuffle_algo where this
    launch says `auto` and the run started in a named one (before `auto` was the default, py1e was); and `auto`'s
    lazy order as the run recorded it (a config from before data.shuffle_auto_lazy: feistel_window), whatever this
    launch says. `auto` never changes a run's order, neither for its relaunch nor for the ledger."""
    data = config.data
    algo = saved["data"].get("shuffle_algo", AUTO_SHUFFLE)
    if data.shuffle_algo == AUTO_SHUFFLE and algo != AUTO_SHUFFLE:
        data = dataclasses.replace(data, shuffle_algo=algo)
    data = dataclasses.replace(data, shuffle_auto_lazy=saved["data"].get("shuffle_auto_lazy", FIRST_LAZY_ORDER))
    return config if data == config.data else dataclasses.replace(config, data=data)


def keep_guard_rewinds(config: TrainConfig, saved: dict) -> TrainConfig:
    """`config` with the rewinds the guard made by itself in the run whose recorded config is `saved` (guard.action
    rewind), and the skips they added: a relaunch of the job's own command (a requeue) goes on in the branch the
    guard chose, never back into the spike."""
    from tokstream.train.spike_guard import joined

    done = (saved.get("guard") or {}).get("rewinds_done") or []
    if len(config.guard.rewinds_done) >= len(done):  # this launch's own (a rewind of the guard's), or none to keep
        return config
    skips = joined([*config.skip_steps, *done[-1]["skip_steps"]])
    return dataclasses.replace(config, skip_steps=skips, guard=dataclasses.replace(config.guard, rewinds_done=done))


# What `auto` took from data.lazy_order_from on before data.shuffle_auto_lazy was recorded (issue 51).
FIRST_LAZY_ORDER = "feistel_window"


def check_relaunch(saved: dict, config: TrainConfig, step: int) -> list[str]:
    """Refuse (UserError) a change the policy does not allow to a run resumed at `step`; return one line per
    accepted change."""
    now = config.to_dict()
    phased = bool(saved.get("phases") or config.phases)
    sources_then, sources_now = len(saved["data"].get("streams", [])), len(now["data"]["streams"])
    if sources_then != sources_now and not phased:
        describe = lambda count: f"a mixture of {count}" if count else "one dataset (data.remote)"  # noqa: E731
        raise UserError(f"data.streams: the checkpoint's run read {describe(sources_then)}, this launch "
                        f"{describe(sources_now)}: {FIXED['data.streams.*']}; keep it, or use a new run_dir")
    old_flat, new_flat = _flatten(saved), _flatten(now)
    changed = [key for key in new_flat if key in old_flat and old_flat[key] != new_flat[key] and key != "resume_allow"
               and not (phased and any(fnmatch(key, pattern) for pattern in PHASE_SETTINGS))]
    # A schedule in tokens (optim.decay_tokens) does not move with max_steps.
    schedule_holds = _decay_steps(saved) == _decay_steps(now) or now["optim"].get("decay_tokens") is not None
    notes = check_phases(saved, config, step) if phased else []
    if "skip_steps" in changed or ("skip_steps" not in old_flat and config.skip_steps):
        notes.append(check_skips(saved.get("skip_steps", []), config.skip_steps, step))
    changed = [key for key in changed if key != "skip_steps"]
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


def check_skips(saved: list, now: list, step: int) -> str:
    """Refuse a change of skip_steps that would change a step the run has trained (a skip that has begun by `step`
    was done, all of it, before its first step); the line for one that begins later."""
    begun = lambda skips: [list(skip) for skip in skips if skip[0] <= step]  # noqa: E731
    if begun(saved) != begun(now):
        changed = next(skip for skip in [*begun(saved), *begun(now)] if (skip in begun(saved)) != (skip in begun(now)))
        raise UserError(f"skip_steps {changed} begins at or before step {step}, which the checkpoint's run has trained "
                        f"with skip_steps {saved}: a skip must begin after step {step}, and the skips already done "
                        "stay as they were")
    return f"skip_steps changed from {saved!r} to {now!r}, after the checkpoint's step {step}"


def _phase_settings(phase: Phase, keys: tuple[str, ...]) -> dict:
    settings = _flatten({"start_step": phase.start_step, "global_batch_size": phase.global_batch_size,
                         "data": dataclasses.asdict(phase.data)})
    return {key: value for key, value in settings.items() if any(fnmatch(key, pattern) for pattern in keys)}


# What a phase's recipe is: a started phase may change only where its data lives (FREE), and the data's
# identity is checked too (Recipe.check_resumes).
RECIPE = ("start_step", "global_batch_size", "data.remote", "data.split", "data.val_split", "data.streams.*")


def _differences(old: dict, new: dict, name: str, ignore: tuple[str, ...] = ()) -> list[str]:
    """"name.key old -> new" for each setting that differs, leaving out those matching `ignore`."""
    return [f"{name}.{key} {old.get(key)!r} -> {new.get(key)!r}" for key in sorted(old.keys() | new.keys())
            if old.get(key) != new.get(key) and not any(fnmatch(key, pattern) for pattern in ignore)]


def check_phases(saved: dict, config: TrainConfig, step: int) -> list[str]:
    """Refuse an edit of a phase that has started by `step` (phase 0 always has); one line for edits of the
    phases after it."""
    old, new = resolve_phases(config_from_dict(saved)), resolve_phases(config)
    read = read_through(step, saved.get("skip_steps", []))  # a skip done read its steps' phases' data too
    started_old = [p for p in old if started(p, read)]
    started_new = [p for p in new if started(p, read)]
    keep = (f"a phase that has started or ended keeps its recipe; edit only phases that start after step {step}, "
            "or use a new run_dir")
    for index in range(max(len(started_old), len(started_new))):
        if index >= len(started_old):
            phase = started_new[index]
            raise UserError(f"{phase.name} would start at step {phase.start_step}, before the checkpoint's step {step}: "
                            f"those steps were trained in {started_old[-1].name}; {keep}")
        if index >= len(started_new):
            phase = started_old[index]
            if index < len(new):  # still there, but moved past the checkpoint
                raise UserError(f"{phase.name} started at step {phase.start_step}, but this launch moves its start_step "
                                f"to {new[index].start_step}, after the checkpoint's step {step}; {keep}")
            raise UserError(f"{phase.name}, which started at step {phase.start_step}, is gone from this launch's "
                            f"phases (the checkpoint is at step {step}); {keep}")
        then, now = started_old[index], started_new[index]
        # Where the data lives may change (FREE); that it is the same data is Recipe.check_resumes' to say.
        differences = _differences(_phase_settings(then, RECIPE), _phase_settings(now, RECIPE), then.name, FREE)
        if differences:
            raise UserError(f"{then.name} has started (at step {then.start_step}; the checkpoint is at step {step}) "
                            f"but changed: {', '.join(differences)}; {keep}")
    later = len(started_old)
    changes = []
    for index in range(later, max(len(old), len(new))):
        if index >= len(new):
            changes.append(f"phases.{index} removed")
        elif index >= len(old):
            changes.append(f"phases.{index} added (from step {new[index].start_step})")
        else:
            changes += _differences(_phase_settings(old[index], RECIPE), _phase_settings(new[index], RECIPE),
                                    old[index].name)
    if not changes:
        return []
    return [f"phases that start after step {step} changed (not started yet, so allowed): " + ", ".join(changes)]
