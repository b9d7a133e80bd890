"""Recipes that change during a run (`phases:`): from a step on, another global batch, other data, and with
it another block size.

The invariant: step s's samples are a function of the config and s alone, whatever the world size,
micro-batch, workers and interruptions. Each phase reads a *stream*: its data's samples, epoch after
epoch, in the reader's order (tokstream.reader.TrainBatches). Phases that read the same data (the same
dataset identity: the same dataset, or the same mixture with the same weights) share one stream, read
in *units*: the global batch of the first phase that reads it, which fixes the stream's epochs (whole
units). A phase's global batch is a whole number of its stream's units, and each step takes the next
ones. So at a boundary:

- data that continues (a batch ramp) keeps its stream's position: no sample comes again before the
  epoch ends, whatever the batch;
- other data is read from where the last phase that read it stopped, or from its start;
- a mixture is one stream over all its sources: a source that moves into another mixture starts over
  within it, and samples it gave before may come again.

The model is built once, for model.block_size, which must be the largest block any phase reads.
"""

import bisect
import dataclasses
from dataclasses import dataclass

from tokstream.errors import UserError
from tokstream.reader import BatchPlan, DataConfig, Dataset, open_dataset
from tokstream.train.config import PhaseData, TrainConfig


@dataclass(frozen=True)
class Phase:
    index: int
    start_step: int
    global_batch_size: int
    data: DataConfig

    @property
    def name(self) -> str:
        return f"phases.{self.index}"


def resolve_phases(config: TrainConfig) -> list[Phase]:
    """The run's phases, each setting resolved (unset: the previous phase's); without `phases`, one phase:
    the run's global_batch_size and data from step 0."""
    if not config.phases:
        return [Phase(0, 0, config.global_batch_size, config.data)]
    phases: list[Phase] = []
    batch, data = config.global_batch_size, config.data
    for index, given in enumerate(config.phases):
        start = given.start_step
        if index == 0 and start != 0:
            raise UserError(f"phases.0.start_step is {start}: the first phase starts at step 0")
        if phases and start <= phases[-1].start_step:
            raise UserError(f"phases.{index}.start_step {start} is not after phases.{index - 1}.start_step "
                            f"{phases[-1].start_step}: list the phases in the order they start")
        batch = given.global_batch_size or batch
        data = _phase_data(data, given.data, config.data)
        phases.append(Phase(index, start, batch, data))
    return phases


def _phase_data(previous: DataConfig, given: PhaseData, run_data: DataConfig) -> DataConfig:
    """The previous phase's data with what this phase names: a dataset or a mixture replaces the previous
    one with its cache (a mixture's cache root defaults to the run's data.local), and split names apply."""
    changes: dict = {key: getattr(given, key) for key in ("split", "val_split") if getattr(given, key) is not None}
    if given.remote or given.streams:
        changes.update(remote=given.remote, streams=list(given.streams),
                       local=given.local if given.local is not None or not given.streams else run_data.local)
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

    @classmethod
    def open(cls, config: TrainConfig, world_size: int) -> "Recipe":
        """Open every phase's data at start, so that a missing or unfit dataset of a late phase is said now."""
        phases = resolve_phases(config)
        vocab, block = config.model.vocab_size, config.model.block_size
        opened: dict[str, Dataset] = {}
        datasets = []
        for phase in phases:
            key = repr(phase.data)
            if key not in opened:  # without phases, the model's block must be the dataset's (open_dataset says so)
                opened[key] = open_dataset(phase.data, vocab, None if config.phases else block)
            datasets.append(opened[key])
        if config.phases:
            largest = max(range(len(phases)), key=lambda i: datasets[i].metadata[0].block_size)
            if datasets[largest].metadata[0].block_size != block:
                raise UserError(f"model.block_size is {block}, but the largest block any phase reads is "
                                f"{datasets[largest].metadata[0].block_size} ({phases[largest].name}): set "
                                f"model.block_size={datasets[largest].metadata[0].block_size}, the model is built "
                                "once for it")
        first_unit: dict[str, tuple[int, Phase]] = {}
        units = []
        for phase, dataset in zip(phases, datasets):
            unit, first = first_unit.setdefault(dataset.identity, (phase.global_batch_size, phase))
            if phase.global_batch_size % unit:
                raise UserError(f"{phase.name}.global_batch_size {phase.global_batch_size} is not a multiple of "
                                f"{unit}, the global batch its data is read in ({first.name}'s, the first phase "
                                f"to read it): use a multiple of {unit}, so that each step takes whole units of "
                                "the data's order")
            units.append(unit)
        recipe = cls(phases, datasets, units, config.micro_batch_size, world_size)
        for phase in phases:
            recipe.plan(phase)  # checks that micro-batches x ranks cut the phase's unit
        return recipe

    def at(self, step: int) -> Phase:
        """The phase that step `step` (0-based) trains in."""
        return self.phases[bisect.bisect_right([p.start_step for p in self.phases], step) - 1]

    def dataset(self, phase: Phase) -> Dataset:
        return self.datasets[phase.index]

    def stream(self, phase: Phase) -> str:
        """The key of the phase's stream: its data's identity."""
        return self.dataset(phase).identity

    def block_size(self, phase: Phase) -> int:
        return self.dataset(phase).metadata[0].block_size

    def plan(self, phase: Phase) -> BatchPlan:
        """The phase's step: its global batch cut into micro-batches over the ranks."""
        self.reader_plan(phase)
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

    def describe_epochs(self) -> list[str]:
        """A line per stream for the start of a run (its epochs, what each source gives them); refuses data too
        small for one of its units."""
        lines, seen = [], set()
        for phase in self.phases:
            if self.stream(phase) not in seen:
                seen.add(self.stream(phase))
                line = self.dataset(phase).describe_epoch(self.reader_plan(phase))
                lines.append(line if len(self.phases) == 1 else f"{phase.name}'s data: {line}")
        return lines

    def check_resumes(self, saved_identities: list[str], step: int) -> None:
        """Refuse to resume if a phase that has started by `step` would read other data than it did."""
        for phase, identity in zip(self.phases, saved_identities):
            if phase.index and phase.start_step >= step:
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
