"""Recipes that change during a run (`phases:`): from a step on, another global batch, other data, and with
it another block size.

The invariant: step s's samples are a function of the config and s alone, whatever the world size,
micro-batch, workers and interruptions. Each phase reads a *stream*: its data's samples, epoch after
epoch, in the reader's order (tokstream.reader.TrainBatches). Phases that read the same data (the same
datasets with the same weights: stream_key) share one stream, read in *units*: the global batch of the
first phase that reads it, which fixes the stream's epochs (whole units). A phase's global batch is a
whole number of its stream's units, and each step takes the next ones; a step of a larger batch may
span its stream's epoch end. So at a boundary:

- data that continues (a batch ramp) keeps its stream's position: no sample comes again before the
  epoch ends, whatever the batch;
- other data is read from where the last phase that read it stopped, or from its start;
- a mixture is one stream over all its sources: a source that moves into another mixture starts over
  within it, and samples it gave before may come again.

The model is built once, for model.block_size, which must be the largest block any phase reads.
"""

import bisect
import dataclasses
import hashlib
import os
from dataclasses import dataclass

from tokstream.errors import UserError
from tokstream.reader import BatchPlan, DataConfig, Dataset, open_dataset
from tokstream.train.config import PhaseData, TrainConfig
from tokstream.train.run_store import run_orders_dir


@dataclass(frozen=True)
class Phase:
    index: int
    start_step: int
    global_batch_size: int
    data: DataConfig

    @property
    def name(self) -> str:
        return f"phases.{self.index}"


def started(phase: Phase, step: int) -> bool:
    """Whether a run at `step` (steps done) has trained in `phase`: phase 0 always has."""
    return phase.index == 0 or phase.start_step < step


def read_through(step: int, skips: list) -> int:
    """How far into the steps' data a run at `step` (steps done) has read: a skip that has begun by then (its first
    step <= `step`) read the data of steps up to its last. `started(phase, read_through(...))`: its data was read."""
    return max([step, *(last for first, last in skips if first <= step)])


def resolve_phases(config: TrainConfig) -> list[Phase]:
    """The run's phases, each setting resolved (unset: the previous phase's); without `phases`, one phase:
    the run's global_batch_size and data from step 0."""
    if not config.phases:
        return [Phase(0, 0, config.global_batch_size, config.data)]
    phases: list[Phase] = []
    batch, data = config.global_batch_size, config.data
    for index, given in enumerate(config.phases):
        start = given.start_step
        if not isinstance(start, int) or start < 0:
            raise UserError(f"phases.{index}.start_step must be a step (a whole number from 0), got {start!r}")
        if given.global_batch_size is not None and given.global_batch_size < 1:
            raise UserError(f"phases.{index}.global_batch_size must be a positive whole number, got "
                            f"{given.global_batch_size!r}")
        if index == 0 and start != 0:
            raise UserError(f"phases.0.start_step is {start}: the first phase starts at step 0")
        if phases and start <= phases[-1].start_step:
            raise UserError(f"phases.{index}.start_step {start} is not after phases.{index - 1}.start_step "
                            f"{phases[-1].start_step}: list the phases in the order they start")
        batch = batch if given.global_batch_size is None else given.global_batch_size
        data = _phase_data(data, given.data, config.data)
        phases.append(Phase(index, start, batch, data))
    return phases


def _phase_data(previous: DataConfig, given: PhaseData, run_data: DataConfig) -> DataConfig:
    """The previous phase's data with what this phase names: a dataset or a mixture replaces the previous
    one with its cache (by default under the run's data.local: a dataset's in <its name>/, a mixture's
    sources each in theirs), and split names apply."""
    changes: dict = {key: getattr(given, key) for key in ("split", "val_split") if getattr(given, key) is not None}
    if given.remote or given.streams:
        local = given.local
        if local is None and run_data.local:
            local = run_data.local if given.streams else os.path.join(run_data.local,
                                                                      os.path.basename(given.remote.rstrip("/")))
        changes.update(remote=given.remote, streams=list(given.streams), local=local)
    elif given.local is not None:
        changes["local"] = given.local
    return dataclasses.replace(previous, **changes)


@dataclass(frozen=True)
class Recipe:
    """The phases with their data opened and checked: the stream each reads, in which unit, at which block."""

    phases: list[Phase]
    datasets: list[Dataset]  # per phase (phases reading the same data share the object)
    units: list[int]  # per phase: its stream's unit, the global batch of the first phase reading it
    micro_batch_size: int
    world_size: int
    vocab_size: int  # the model's: each phase's data is checked against it when opened
    skips: tuple[tuple[int, int], ...] = ()  # skip_steps: (first, last), steps counted from 1

    @classmethod
    def open(cls, config: TrainConfig, world_size: int, keep_orders: bool = True) -> "Recipe":
        """Open every phase's data at start, so that a missing or unfit dataset of a late phase is said now.
        `keep_orders`: the run's readers keep streaming's epoch orders as files (data.order_dir, by default in the
        run's orders/); a reader of the run that writes nothing (the ledger) computes them in memory."""
        if config.data.order_dir is None and keep_orders:  # files every relaunch maps (order_files.py)
            config = dataclasses.replace(config, data=dataclasses.replace(config.data, order_dir=str(
                run_orders_dir(config.run_dir, config.run_local))))
        phases = resolve_phases(config)
        vocab, block = config.model.vocab_size, config.model.block_size
        opened: dict[str, Dataset] = {}
        datasets = []
        for phase in phases:
            key = repr(phase.data)
            if key not in opened:  # without phases, the model's block must be the dataset's (open_dataset says so)
                try:
                    opened[key] = open_dataset(phase.data, vocab, None if config.phases else block)
                except UserError as err:
                    raise UserError(f"{phase.name}: {err}" if config.phases else str(err)) from None
            datasets.append(opened[key])
        check_caches_apart(phases, datasets)
        for phase, dataset in zip(phases[1:], datasets[1:]):
            difference = dataset.token_difference(datasets[0])
            if difference is not None:
                key, value, first = difference
                raise UserError(f"{phase.name}'s data ({_where(phase)}) has {key}={value!r}, phases.0's {first!r}: "
                                "every phase feeds one model, so its data must share the tokenizer, vocabulary and "
                                "separator (and its position); reconvert it")
        if config.phases:
            blocks = [dataset.metadata[0].block_size for dataset in datasets]
            largest = blocks.index(max(blocks))
            if blocks[largest] != block:
                raise UserError(f"model.block_size is {block}, but the largest block any phase reads is "
                                f"{blocks[largest]} ({phases[largest].name}): set model.block_size={blocks[largest]}, "
                                "the model is built once for it")
        first_unit: dict[str, tuple[int, Phase]] = {}
        units = []
        for phase, dataset in zip(phases, datasets):
            unit, first = first_unit.setdefault(stream_key(dataset), (phase.global_batch_size, phase))
            if phase.global_batch_size % unit:
                raise UserError(f"{phase.name}.global_batch_size {phase.global_batch_size} is not a multiple of "
                                f"{unit}, the global batch its data is read in ({first.name}'s, the first phase "
                                f"to read it): use a multiple of {unit}, so that each step takes whole units of "
                                "the data's order")
            units.append(unit)
        return cls(phases, datasets, units, config.micro_batch_size, world_size, vocab,
                   tuple((first, last) for first, last in config.skip_steps))

    def changed_since_opened(self, phase: Phase) -> str | None:
        """Why `phase`'s data, opened again now, is not what open() found (another conversion replaced it, or it
        is gone or incomplete), or None: a run reads what it recorded, or stops."""
        try:
            found = open_dataset(phase.data, self.vocab_size, None).identity
        except UserError as err:
            return f"{phase.name}'s data ({_where(phase)}) can no longer be read: {err}"
        if found != self.dataset(phase).identity:
            return (f"{phase.name}'s data ({_where(phase)}) changed since this launch opened it (identity "
                    f"{self.dataset(phase).identity}, now {found})")
        return None

    def check_plans(self, step: int) -> None:
        """Refuse micro-batches x ranks that do not cut the unit of a phase run at or after `step` (steps done):
        an ended phase's no longer counts."""
        for phase in self.phases:
            if not self.ended(phase, step):
                self.reader_plan(phase)


    def ended(self, phase: Phase, step: int) -> bool:
        """Whether a run at `step` (steps done) is past `phase`: the next phase starts by then."""
        return phase.index + 1 < len(self.phases) and self.phases[phase.index + 1].start_step <= step

    def at(self, step: int) -> Phase:
        """The phase that step `step` (0-based) trains in."""
        return self.phases[bisect.bisect_right([p.start_step for p in self.phases], step) - 1]

    def dataset(self, phase: Phase) -> Dataset:
        return self.datasets[phase.index]

    def stream(self, phase: Phase) -> str:
        """The key of the phase's stream (stream_key)."""
        return stream_key(self.dataset(phase))

    def data_digest(self, phase: Phase) -> str:
        """A short name of the data the phase reads (its stream: the datasets' identities and weights), which
        metrics.jsonl records with each step (train/ledger.py checks it)."""
        return hashlib.sha256(self.stream(phase).encode()).hexdigest()[:12]

    def block_size(self, phase: Phase) -> int:
        return self.dataset(phase).metadata[0].block_size

    def changes_statistics(self, phase: Phase) -> bool:
        """Whether `phase` reads other data, batches or blocks than the phase before it: the loss and gradient norm
        move by design at its start (the spike guard starts its window again)."""
        if phase.index == 0:
            return False
        before = self.phases[phase.index - 1]
        return (phase.data != before.data or phase.global_batch_size != before.global_batch_size
                or self.block_size(phase) != self.block_size(before))

    def plan(self, phase: Phase) -> BatchPlan:
        """The phase's step: its global batch cut into micro-batches over the ranks (check_plans says why not)."""
        return BatchPlan(phase.global_batch_size, self.micro_batch_size, self.world_size)

    def reader_plan(self, phase: Phase) -> BatchPlan:
        """The plan its stream is read with: the stream's unit as the global batch."""
        unit = self.units[phase.index]
        try:
            return BatchPlan(unit, self.micro_batch_size, self.world_size)
        except UserError:
            if len(self.phases) == 1:
                raise
            raise UserError(f"{phase.name} reads its data in units of {unit} samples (the global batch of the "
                            f"first phase to read it), which micro_batch_size {self.micro_batch_size} x "
                            f"{self.world_size} ranks does not divide: lower micro_batch_size") from None

    def tokens_before(self, step: int) -> int:
        """Tokens trained on in steps 0 .. step - 1: each sample gives block_size predictions."""
        tokens = 0
        for phase, following in zip(self.phases, self.phases[1:] + [None]):
            end = min(step, following.start_step) if following else step
            tokens += max(0, end - phase.start_step) * phase.global_batch_size * self.block_size(phase)
        return tokens

    def units_before(self, phase: Phase, step: int) -> int:
        """How many units of `phase`'s stream the steps before `step` (0-based) took: each step of each phase that
        reads that stream takes its global batch's worth (train/ledger.py; PhasedBatches tracks the same position
        as it reads)."""
        stream, unit = self.stream(phase), self.units[phase.index]
        taken = 0
        for other, following in zip(self.phases, self.phases[1:] + [None]):
            if self.stream(other) == stream:
                end = min(step, following.start_step) if following else step
                taken += max(0, end - other.start_step) * (other.global_batch_size // unit)
        return taken

    def read_units_before(self, phase: Phase, step: int) -> int:
        """How far into `phase`'s stream step `step` (0-based) reads: the units the steps before it took, and those
        the skips that have begun by then left out (the units steps first..last would have taken from the stream:
        the trainer reads them and leaves them out, skip_when_due)."""
        skipped = sum(self.units_before(phase, last) - self.units_before(phase, first - 1)
                      for first, last in self.skips if first - 1 <= step)
        return self.units_before(phase, step) + skipped

    def skip_at(self, step: int) -> tuple[int, int] | None:
        """The skip that begins at step `step` (0-based), if any."""
        return next((skip for skip in self.skips if skip[0] == step + 1), None)

    def describe_epochs(self) -> list[str]:
        """A line per stream for the start of a run (its epochs, what each source gives them); refuses data too
        small for one of its units."""
        lines, seen = [], set()
        for phase in self.phases:
            if self.stream(phase) not in seen:
                seen.add(self.stream(phase))
                unit = self.units[phase.index]
                try:
                    line = self.dataset(phase).describe_epoch(BatchPlan(unit, 1, 1))  # the epoch depends on the unit alone
                except UserError as err:
                    if len(self.phases) == 1:
                        raise
                    raise UserError(f"{phase.name}'s data ({_where(phase)}): {err}") from None
                lines.append(line if len(self.phases) == 1 else
                             f"{phase.name}'s data: " + line.replace(" steps: ", f" steps of {unit} samples: ", 1))
        return lines

    def unreached(self, max_steps: int) -> list[str]:
        """A line for each phase that starts at or after max_steps: it is checked, but will not run."""
        return [f"{phase.name} starts at step {phase.start_step}, at or after max_steps {max_steps}: it will not run "
                "(a relaunch with a larger max_steps reaches it)" for phase in self.phases if phase.start_step >= max_steps
                and phase.index]

    def check_resumes(self, saved_identities: list[str], step: int) -> None:
        """Refuse to resume if a phase that has started by `step` would read other data than it did."""
        for phase, identity in zip(self.phases, saved_identities):
            if not started(phase, step):
                break
            try:
                self.dataset(phase).check_resumes(identity)
            except UserError:
                if len(self.phases) == 1:
                    raise
                raise UserError(f"{phase.name}'s data differs from the one the checkpoint's run read in it; "
                                "use a new run_dir") from None

    def describe(self, phase: Phase) -> str:
        """The line said when a phase begins (or a run resumes in it)."""
        dataset = self.dataset(phase)
        data = dataset.config.remote or "a mixture of " + ", ".join(dataset.source_names)
        return (f"{phase.name} from step {phase.start_step}: global batch {phase.global_batch_size} "
                f"(accumulation {self.plan(phase).accumulation}), block {self.block_size(phase)}, {data}")


def check_caches_apart(phases: list[Phase], datasets: list[Dataset]) -> None:
    """Two datasets cached in one folder (a phase's cache is data.local/<the dataset folder's name>, and two
    datasets may share a name) would read each other's shards: refuse, naming the setting that parts them."""
    cached: dict[str, tuple[str, Phase]] = {}
    for phase, dataset in zip(phases, datasets):
        for source, cache in zip(dataset.sources, dataset.cache_roots):
            remote = source.remote.rstrip("/")
            other = cached.setdefault(cache, (remote, phase))
            if other[0] != remote:
                raise UserError(f"{phase.name}'s data ({remote}) and {other[1].name}'s ({other[0]}) would share the "
                                f"cache {cache} and read each other's shards: give {phase.name}.data.local a folder "
                                "of its own")


def _where(phase: Phase) -> str:
    """Where a phase's data lies, for its refusals: the dataset, or a mixture's sources."""
    return phase.data.remote or ", ".join(stream.remote for stream in phase.data.streams)


def stream_key(dataset: Dataset, former: bool = False) -> str:
    """What makes phases read one stream: the same datasets (their identity) with the same weights. `former`: the
    key checkpoints made before 2026-11-28 filed it under (Dataset.former_identity)."""
    identity = dataset.former_identity if former else dataset.identity
    weights = [(source.weight, source.value) for source in dataset.sources]
    return identity if weights == [(None, None)] else f"{identity} {weights}"
