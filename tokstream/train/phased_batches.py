"""The run's micro-batches across phases, and the checkpoint's `loader`: each stream's position (phases.py)
and the samples and tokens each source has given the run."""

import numpy as np
import torch

from tokstream.reader import TrainBatches
from tokstream.train.phases import Phase, Recipe, stream_key


class PhasedBatches:
    """Reads the current phase's stream through one TrainBatches; a phase reading other data closes it,
    keeps its position, and opens the other stream where it stood."""

    def __init__(self, recipe: Recipe, pin_memory: bool, max_documents: int | None = None):
        self.recipe = recipe
        self.pin_memory = pin_memory
        self.max_documents = max_documents  # TrainBatches': each micro-batch with its documents
        self.positions: dict[str, dict] = {}  # stream -> TrainBatches.state_dict(), where it was last left
        # Per source dataset (its identity, whatever mixture it is read in): {"name", "samples", "tokens"}.
        self.consumed: dict[str, dict] = {}
        self.stream: str | None = None
        self.batches: TrainBatches | None = None
        self.read_since_enter = False  # a stream opened and not read keeps the position it was saved with

    def enter(self, phase: Phase) -> bool:
        """Read `phase`'s stream from now on; True when that opened it (the data changed, or the first call)."""
        stream = self.recipe.stream(phase)
        if stream == self.stream:
            return False
        self.close()
        batches = TrainBatches(self.recipe.dataset(phase), self.recipe.reader_plan(phase), pin_memory=self.pin_memory,
                               reuse_buffers=True,  # the trainer copies each micro-batch to the device at once
                               max_documents=self.max_documents)
        if stream in self.positions:
            batches.load_state_dict(self.positions[stream])
        self.stream, self.batches, self.read_since_enter = stream, batches, False
        return True

    def move(self, phase: Phase, units: int) -> None:
        """Read `phase`'s stream from `units` units into it on, what lies between left unread (skip_steps): its
        position is set where reading would have brought it, as a relaunch would set it."""
        self.enter(phase)
        state = self.batches.state_dict()
        samples, epoch = units * self.recipe.units[phase.index], sum(self.batches.epoch_samples)
        position = {**state["position"], "epoch": samples // epoch, "sample_in_epoch": samples % epoch}
        stream = self.stream
        self.close()
        self.positions[stream] = {**state, "position": position}
        self.enter(phase)

    def __next__(self) -> dict[str, torch.Tensor]:
        self.read_since_enter = True
        return next(self.batches)

    def samples_per_source(self, sample_ids: list[int]) -> np.ndarray:
        return self.batches.samples_per_source(sample_ids)

    def count(self, phase: Phase, samples_per_source: list[int]) -> None:
        """Add one step's samples (all ranks', per source of the phase's data) to what each source has given."""
        dataset, block = self.recipe.dataset(phase), self.recipe.block_size(phase)
        for identity, name, samples in zip(dataset.source_identities, dataset.source_names, samples_per_source):
            totals = self.consumed.setdefault(identity, {"name": name, "samples": 0, "tokens": 0})
            totals["name"] = name  # the latest name it was read under
            totals["samples"] += samples
            totals["tokens"] += samples * block

    def consumed_by_name(self) -> dict[str, dict[str, int]]:
        """What each source dataset has given, by its name (with its identity where two datasets share one)."""
        names = [totals["name"] for totals in self.consumed.values()]
        return {(totals["name"] if names.count(totals["name"]) == 1 else f"{totals['name']} ({identity[:8]})"):
                {"samples": totals["samples"], "tokens": totals["tokens"]} for identity, totals in self.consumed.items()}

    def state_dict(self) -> dict:
        positions = dict(self.positions)
        if self.batches is not None and self.read_since_enter:
            positions[self.stream] = self.batches.state_dict()
        return {"streams": positions, "consumed": {key: dict(totals) for key, totals in self.consumed.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Before the first enter(). A checkpoint from before phases holds its one reader's state."""
        if "streams" not in state:
            self.positions = {self.recipe.stream(self.recipe.phases[0]): state}
            return
        # A checkpoint made before 2026-11-28 filed streams and sources under their former identities.
        streams, sources = {}, {}
        for dataset in self.recipe.datasets:
            streams[stream_key(dataset, former=True)] = stream_key(dataset)
            sources.update(zip(dataset.former_source_identities, dataset.source_identities))
        self.positions = {streams.get(key, key): position for key, position in state["streams"].items()}
        self.consumed = {sources.get(key, key): dict(totals) for key, totals in state["consumed"].items()}

    def close(self) -> None:
        if self.batches is not None:
            if self.read_since_enter:
                self.positions[self.stream] = self.batches.state_dict()
            self.batches.close()
        self.stream = self.batches = None
