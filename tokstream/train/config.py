"""Training configuration: typed dataclasses loaded from YAML, with dotted key=value overrides."""

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tokstream.errors import UserError
from tokstream.reader import DataConfig, StreamConfig  # noqa: F401  (the `data:` section)


@dataclass
class ModelConfig:
    vocab_size: int = 50304  # GPT-2's 50257 rounded up to a multiple of 64 for fast matmuls
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = False
    # causal: every token attends to the block before it; document: only to its own document's tokens
    # (separators from the dataset's metadata; README, "Document attention").
    attention: str = "causal"
    positions: str = "absolute"  # or document: position embeddings restart at each document (with attention: document)


@dataclass
class OptimConfig:
    lr: float = 6e-4
    min_lr: float = 6e-5
    warmup_steps: int = 2000
    decay_steps: int | None = None  # cosine decay length; defaults to max_steps
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    # The schedule counted in tokens instead of steps, so that a batch ramp (phases) does not stretch it:
    # warmup over warmup_tokens, cosine to min_lr at decay_tokens (both needed; warmup/decay_steps unused).
    warmup_tokens: int | None = None
    decay_tokens: int | None = None


@dataclass
class GuardConfig:
    """The loss-spike guard (tokstream/train/spike_guard.py, docs/loss-spikes.md)."""

    zscore: float = 0.0  # a step this many standard deviations above the window's loss or gradient norm; 0: off
    window: int = 128  # steps
    action: str = "skip"  # skip: its update is not applied; stop: exit 65 with the command that rewinds and skips;
    # rewind: what that command would do, in the same job, up to max_rewinds times per run
    rewind: int = 100  # stop/rewind: back to a checkpoint at least this many steps before the spike
    skip: int = 200  # stop/rewind: and leave out this many steps' data from the spike on
    max_rewinds: int = 3  # rewind: then it stops, as stop does
    # Recorded by the guard's own rewinds, not set by hand: [{"spike", "resume_from", "skip_steps"}, ...]; a relaunch
    # keeps them (resume_policy.keep_guard_rewinds), as it keeps the skips they added.
    rewinds_done: list = field(default_factory=list)


@dataclass
class LogConfig:
    """Where rank 0 also sends each step's record (tokstream/train/dashboards.py): `pip install tokstream[dashboards]`."""

    tensorboard: str | None = None  # a folder for TensorBoard's event files (tensorboard --logdir it)
    # wandb.init's settings, e.g. {project: gpt2-owt, entity: me}; its mode from WANDB_MODE (offline: files only)
    wandb: dict | None = None


@dataclass
class PhaseData:
    """What a phase reads: a dataset (remote) or a mixture (streams), as under `data:`. Unset: the previous
    phase's. How the data is read (workers, cache, shuffle settings) is the run's `data:` section."""

    remote: str = ""
    local: str | None = None  # a remote's cache, or a mixture's cache root (its sources under it)
    streams: list[StreamConfig] = field(default_factory=list)
    split: str | None = None
    val_split: str | None = None


@dataclass
class PhaseConfig:
    """Part of a run from `start_step` on (tokstream/train/phases.py): its global batch and data."""

    start_step: int = 0
    global_batch_size: int | None = None  # unset: the previous phase's (the first's: global_batch_size)
    data: PhaseData = field(default_factory=PhaseData)


@dataclass
class TrainConfig:
    run_dir: str = "runs/default"  # a path, or s3://bucket/prefix so that checkpoints outlive the node
    run_local: str | None = None  # an S3 run's node-local scratch (metrics as written, staging); default under TMPDIR
    max_steps: int = 600000
    global_batch_size: int = 480  # samples per optimizer step, over all ranks and micro-batches
    micro_batch_size: int = 12  # samples per rank per forward pass
    seed: int = 1337
    device: str = "auto"  # auto: cuda if available, else cpu
    dtype: str = "bfloat16"  # autocast dtype on GPU; CPU runs in float32
    compile: bool = False
    # Deterministic kernels (torch.use_deterministic_algorithms): a resumed GPU run then repeats the
    # uninterrupted run's losses bit for bit, at some cost in speed. CPU runs are deterministic anyway.
    deterministic: bool = False
    log_interval: int = 10
    eval_interval: int = 2000  # 0: no evaluation
    eval_batches: int = 20
    checkpoint_interval: int = 1000
    keep_checkpoints: int = 3  # 0: keep every checkpoint
    keep_every: int = 0  # also keep every checkpoint at a multiple of this step (rewind targets); 0: none
    # Periodic checkpoints are copied to host memory at the step boundary and written while training
    # goes on; preemption and final saves always wait until written.
    background_checkpoints: bool = True
    # Seconds between a preemption notice (SIGTERM) and the kill: Kubernetes' default 30 s, about 120 s
    # for cloud spot notices. Start-up warns when a step plus the saves could not fit in it.
    preempt_grace_s: float = 30.0
    # Rank 0 rewrites run_dir/LEASE this often; a launch takes over a lease that has not moved for 3
    # of its holder's intervals (at once when the holder ran on this machine and is gone): run_lease.py.
    lease_interval_s: float = 10.0
    trace_samples: bool = False
    # Recipe settings a relaunch changes on purpose, e.g. [optim.lr]; any other change is refused
    # (resume_policy.py says what may change freely).
    resume_allow: list[str] = field(default_factory=list)
    # A recipe that changes during the run: global batch, data and block size from a step on (README, "Phases").
    phases: list[PhaseConfig] = field(default_factory=list)
    # Steps whose data is left out, [[A, B], ...] (both counted, from 1 as metrics.jsonl counts): on reaching step A
    # the run reads what step B + 1 would have read, and goes on from there (docs/loss-spikes.md). A pair, not
    # A:B, which YAML reads as a number in base 60.
    skip_steps: list[list[int]] = field(default_factory=list)
    # Resume from this earlier checkpoint of the run instead of the newest: what came after is moved aside into
    # run_dir/abandoned/ (rewind.py). Relaunching the same command goes on in the new branch.
    resume_from: int | None = None
    guard: GuardConfig = field(default_factory=GuardConfig)
    log: LogConfig = field(default_factory=LogConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _apply(target: object, key: str, value: object, where: str, prefix: str = "") -> None:
    """Set `key` (dotted, relative to `target`, whose own path is `prefix`) to `value`."""
    head, _, rest = key.partition(".")
    names = {f.name: f for f in dataclasses.fields(target)}
    full = prefix + key
    if head not in names:
        raise UserError(f"{where}: unknown config key {full!r}; valid here: {', '.join(names)}")
    current = getattr(target, head)
    item_types = typing.get_args(names[head].type) if isinstance(current, list) else ()
    if item_types and dataclasses.is_dataclass(item_types[0]):
        return _apply_to_list(current, item_types[0], f"{prefix}{head}", rest, value, where)
    if dataclasses.is_dataclass(current):
        if rest:
            return _apply(current, rest, value, where, f"{prefix}{head}.")
        if not isinstance(value, dict):
            raise UserError(f"{where}: {full} is a section, give it keys")
        return _apply_section(current, value, where, f"{full}.")
    if rest:
        raise UserError(f"{where}: {prefix}{head} is not a section, cannot set {full!r}")
    expected = _value_type(names[head].type, current)
    if expected is bool and not isinstance(value, bool):
        raise UserError(f"{where}: {full} must be true or false, got {value!r}")
    if expected is float and isinstance(value, (int, str)) and not isinstance(value, bool):
        try:
            value = float(value)  # YAML reads 1e-3 (no dot) as a string
        except ValueError:
            pass
    if expected is int and isinstance(value, (float, str)) and not isinstance(value, bool):
        value = _whole_number(value)  # token counts: 4.0e6, or 4e6 (a string to YAML)
    if expected is not None and value is not None and (not isinstance(value, expected) or
                                                       (expected is int and isinstance(value, bool))):
        if full == "skip_steps":
            check_skips(value)  # its own line: 12:14 is a number to YAML
        if full == "guard.rewinds_done":
            check_rewinds_done(value)
        what = {int: "a whole number", float: "a number", str: "text", list: "a list"}.get(expected, expected.__name__)
        raise UserError(f"{where}: {full} must be {what}, got {value!r}")
    _check_plain(value, f"{where}: {full}")
    setattr(target, head, value)


def _check_plain(value: object, what: str) -> None:
    """Settings are recorded as JSON (checkpoint manifests, metrics): text, numbers, true/false and lists or
    sections of them. YAML also reads dates (2024-01-01), which would fail the first save."""
    if isinstance(value, (list, tuple)):
        for item in value:
            _check_plain(item, what)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_plain(key, what)
            _check_plain(item, what)
    elif value is not None and not isinstance(value, (str, int, float)):
        raise UserError(f"{what} must be text, a number or true/false, got {value!r} (YAML reads it as a "
                        f"{type(value).__name__}: quote it)")


def _whole_number(value: float | str) -> int | float | str:
    try:
        number = float(value)
    except ValueError:
        return value
    return int(number) if number.is_integer() else value


def _value_type(annotation: object, current: object) -> type | None:
    """The type a setting takes: its default's, or for a None default the annotation's (`float | None`)."""
    if current is not None:
        return type(current)
    types = [t for t in typing.get_args(annotation) if t is not type(None)]
    return types[0] if len(types) == 1 and isinstance(types[0], type) else None


def _apply_to_list(items: list, item_type: type, name: str, rest: str, value: object, where: str) -> None:
    """A list of sections `name`: `name=[{...}, ...]` replaces it; `name.N.key=value` sets one key of
    item N, and N equal to its length appends an item."""
    if not rest:
        if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
            raise UserError(f"{where}: {name} must be a list of sections, got {value!r}")
        items.clear()
        for index, item in enumerate(value):
            items.append(item_type())
            _apply_section(items[-1], item, where, f"{name}.{index}.")
        return
    index, _, item_key = rest.partition(".")
    if not index.isdigit() or int(index) > len(items):
        raise UserError(f"{where}: {name} has {len(items)} items, so {name}.0 to {name}.{len(items)} "
                        f"(which appends one), not {name}.{index}")
    if int(index) == len(items):
        items.append(item_type())
    if item_key:
        _apply(items[int(index)], item_key, value, where, f"{name}.{index}.")
    elif isinstance(value, dict):
        _apply_section(items[int(index)], value, where, f"{name}.{index}.")
    else:
        raise UserError(f"{where}: {name}.{index} is a section, give it keys")


def _apply_section(target: object, value: dict, where: str, prefix: str) -> None:
    for sub_key, sub_value in value.items():
        _apply(target, str(sub_key), sub_value, where, prefix)


def _parse_yaml(text: str, what: str, fix: str) -> object:
    """YAML, or one line saying where it is not (yaml's own message spans several, with a caret)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise UserError(f"{what} is not valid YAML{where}: {problem}; {fix}") from None


def config_from_dict(saved: dict) -> TrainConfig:
    """The TrainConfig a checkpoint recorded (TrainConfig.to_dict()); settings added since keep their defaults."""
    config = TrainConfig()
    _apply_section(config, saved, "the checkpoint's config", "")
    return config


def apply_overrides(config: TrainConfig, overrides: list[str]) -> TrainConfig:
    """`key=value` settings (values parsed as YAML) over `config`, in place."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise UserError(f"override {item!r} is not key=value")
        value = _parse_yaml(raw, f"override {item!r}: {raw!r}",
                            "quote a string YAML would misread inside the argument, e.g. 'key=\"[a\"'") if raw else None
        _apply(config, key.strip(), value, "command line")
    return config


# Each numeric setting's range, checked once when a config is loaded (check_ranges): (lowest, whether the lowest
# itself is allowed, highest or None, what the value means at the edge, if anything).
RANGES = {
    "seed": (0, True, 2**31, "each rank seeds with seed + its rank"), "max_steps": (1, True, None, ""), "global_batch_size": (1, True, None, ""), "micro_batch_size": (1, True, None, ""),
    "log_interval": (1, True, None, ""), "eval_interval": (0, True, None, "0 turns evaluation off"),
    "eval_batches": (1, True, None, ""), "checkpoint_interval": (1, True, None, ""),
    "keep_checkpoints": (0, True, None, "0 keeps every checkpoint"), "keep_every": (0, True, None, "0 keeps none"),
    "resume_from": (0, True, None, "a checkpoint's step"), "guard.zscore": (0, True, None, "0 turns the guard off"),
    "guard.window": (16, True, None, "a step is judged once the window holds 16 steps"), "guard.rewind": (0, True, None, ""), "guard.skip": (1, True, None, ""), "guard.max_rewinds": (0, True, None, ""), "preempt_grace_s": (0, False, None, ""),
    "lease_interval_s": (0, False, None, ""),
    "model.vocab_size": (1, True, None, ""), "model.block_size": (1, True, None, ""), "model.n_layer": (1, True, None, ""),
    "model.n_head": (1, True, None, ""), "model.n_embd": (1, True, None, ""), "model.dropout": (0, True, 1, ""),
    "optim.lr": (0, True, None, ""), "optim.min_lr": (0, True, None, ""), "optim.warmup_steps": (0, True, None, ""),
    "optim.decay_steps": (1, True, None, ""), "optim.weight_decay": (0, True, None, ""),
    "optim.beta1": (0, True, 1, ""), "optim.beta2": (0, True, 1, ""), "optim.grad_clip": (0, True, None, "0 turns clipping off"),
    "optim.warmup_tokens": (0, True, None, ""), "optim.decay_tokens": (1, True, None, ""),
    "data.shuffle_seed": (0, True, 2**32, ""), "data.shuffle_block_size": (1, True, None, ""),
    "data.num_canonical_nodes": (1, True, None, ""), "data.num_workers": (0, True, None, ""),
    "data.prefetch_factor": (1, True, None, ""), "data.predownload": (1, True, None, ""),
    "data.download_retry": (0, True, None, ""), "data.max_documents": (1, True, None, ""),
    "data.lazy_order_from": (1, True, None, "samples from which `auto` reads a dataset in the lazy order"),
}


def check_skips(skips: object, max_steps: int | None = None) -> None:
    """skip_steps: pairs [A, B] of steps counted from 1, A <= B <= max_steps, in order and apart; one line refusing
    anything else."""
    example = "e.g. skip_steps=[[1200,1450]]"
    if isinstance(skips, int) and not isinstance(skips, bool):
        raise UserError(f"skip_steps must be a list of [first, last] pairs, got {skips!r} (YAML reads A:B as a number "
                        f"in base 60): {example}")
    if not isinstance(skips, list):
        raise UserError(f"skip_steps must be a list of [first, last] pairs, got {skips!r}: {example}")
    previous = 0
    for pair in skips:
        if isinstance(pair, int) and not isinstance(pair, bool):
            raise UserError(f"skip_steps holds {pair!r}, a number (YAML reads A:B in base 60): give the pair as "
                            f"[A, B], {example}")
        whole = isinstance(pair, list) and len(pair) == 2 and all(
            isinstance(step, int) and not isinstance(step, bool) for step in pair)
        if not whole or not 1 <= pair[0] <= pair[1]:
            raise UserError(f"skip_steps holds {pair!r}: each skip is [first, last], steps counted from 1 with "
                            f"first <= last, {example}")
        if pair[0] <= previous:
            raise UserError(f"skip_steps: {pair!r} starts at or before the end of the skip before it ({previous}): "
                            "list the skips in order, apart")
        if max_steps is not None and pair[1] > max_steps:
            raise UserError(f"skip_steps: {pair!r} ends past max_steps={max_steps}: a skip leaves out steps the run "
                            "trains, so it ends at max_steps at the latest (a typo?)")
        previous = pair[1]


# Settings where .inf means something: no deadline for the grace, no clipping at all.
MAY_BE_INFINITE = ("preempt_grace_s", "optim.grad_clip")


def check_ranges(config: TrainConfig) -> None:
    """Refuse, in one line naming it, a numeric setting outside its range (RANGES): a zero interval would divide
    by zero after the first step, with nothing saved."""
    defaults = TrainConfig()
    for key, (lowest, inclusive, highest, meaning) in RANGES.items():
        value, default = config, defaults
        for part in key.split("."):
            value, default = getattr(value, part), getattr(default, part)
        if value is None:
            if default is None:  # a setting whose default is None: unset
                continue
            raise UserError(f"{key} must be set, got null" + (f" ({meaning})" if meaning else ""))
        above = value >= lowest if inclusive else value > lowest
        if above and (highest is None or value < highest) and (math.isfinite(value) or key in MAY_BE_INFINITE):
            continue
        whole = isinstance(value, int)
        low = f"at least {lowest}" if inclusive else f"above {lowest}"
        rule = (f"{'a whole number ' if whole else 'a finite number ' if key not in MAY_BE_INFINITE else ''}{low}"
                + (f" and below {highest}" if highest is not None else ""))
        raise UserError(f"{key} must be {rule}, got {value!r}" + (f" ({meaning})" if meaning else ""))
    if config.model.n_embd % config.model.n_head:
        raise UserError(f"model.n_embd {config.model.n_embd} is not a multiple of model.n_head {config.model.n_head}: "
                        "each head takes an equal share of the embedding")


def check_rewinds_done(done: object) -> None:
    """guard.rewinds_done as the guard records it: [{"spike", "resume_from", "skip_steps"}, ...], each rewind to a
    step before its spike; one line refusing anything else (a relaunch would otherwise fail on it, or count it)."""
    def whole(value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value > 0

    for entry in done if isinstance(done, list) else [None]:
        valid = (isinstance(entry, dict) and set(entry) == {"spike", "resume_from", "skip_steps"}
                 and whole(entry["spike"]) and whole(entry["resume_from"]) and entry["resume_from"] < entry["spike"])
        if valid:
            try:
                check_skips(entry["skip_steps"])
            except UserError:
                valid = False
        if not valid:
            raise UserError(f"guard.rewinds_done holds {entry if isinstance(done, list) else done!r}: it is recorded "
                            "by the guard's own rewinds ({spike, resume_from, skip_steps} each), not set by hand; "
                            "leave it out")


def load_config(path: str | None, overrides: list[str] = ()) -> TrainConfig:
    """Defaults, then the YAML file, then `key=value` overrides (values parsed as YAML)."""
    config = TrainConfig()
    if path:
        if not Path(path).is_file():
            raise UserError(f"config file {path} does not exist (see configs/)")
        loaded = _parse_yaml(Path(path).read_text(), f"config file {path}", "fix it there") or {}
        if not isinstance(loaded, dict):
            raise UserError(f"config file {path} holds a {type(loaded).__name__}, not keys and values (see configs/)")
        for key, value in loaded.items():
            _apply(config, str(key), value, path)
    apply_overrides(config, overrides)
    check_ranges(config)
    check_skips(config.skip_steps, config.max_steps)
    check_rewinds_done(config.guard.rewinds_done)
    if config.guard.action not in ("skip", "stop", "rewind"):
        raise UserError(f"guard.action must be skip (the spike's update is not applied), stop (exit 65 with the "
                        f"command that rewinds and skips) or rewind (that command's rewind, in the same job), got "
                        f"{config.guard.action!r}")
    first = config.phases[0].data if config.phases else config.data
    if not (config.data.remote or config.data.streams or first.remote or first.streams):
        raise UserError("data.remote is not set: give the dataset root, e.g. data.remote=data/owt, or a mixture "
                        "in data.streams (with phases: or in phases.0.data)")
    return config
