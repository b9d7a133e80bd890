"""The run's micro-batches across phases, and the checkpoint's `loader`: each stream's position (phases.py)
and the samples and tokens each source has given the run."""

import gc

import numpy as np
import torch

from tokstream.reader import TrainBatches
from tokstream.train.phases import Phase, Recipe


class PhasedBatches:
    """Reads the current phase's stream through one TrainBatches; a phase reading other data closes it,
    keeps its position, and opens the other stream where it stood."""

    def __init__(self, recipe: Recipe, pin_memory: bool):
        self.recipe = recipe
        self.pin_memory = pin_memory
        self.positions: dict[str, dict] = {}  # stream -> TrainBatches.state_dict(), for the streams not open
        self.consumed: dict[str, dict[str, int]] = {}  # source name -> {"samples": n, "tokens": n}, all phases
        self.stream: str | None = None
        self.batches: TrainBatches | None = None

    def enter(self, phase: Phase) -> bool:
        """Read `phase`'s stream from now on; True when that opened it (the data changed, or the first call)."""
        stream = self.recipe.stream(phase)
        if stream == self.stream:
            return False
        self.close()
        # The closed reader's StreamingDataset goes first: a stream read again registers the same directories.
        gc.collect()
        batches = TrainBatches(self.recipe.dataset(phase), self.recipe.reader_plan(phase), pin_memory=self.pin_memory,
                               reuse_buffers=True)  # the trainer copies each micro-batch to the device at once
        if stream in self.positions:
            batches.load_state_dict(self.positions.pop(stream))
        self.stream, self.batches = stream, batches
        return True

    def __next__(self) -> dict[str, torch.Tensor]:
        return next(self.batches)

    def samples_per_source(self, sample_ids: list[int]) -> np.ndarray:
        return self.batches.samples_per_source(sample_ids)

    def count(self, phase: Phase, samples_per_source: list[int]) -> None:
        """Add one step's samples (all ranks', per source of the phase's data) to what each source has given."""
        block = self.recipe.block_size(phase)
        for name, samples in zip(self.recipe.dataset(phase).source_names, samples_per_source):
            totals = self.consumed.setdefault(name, {"samples": 0, "tokens": 0})
            totals["samples"] += samples
            totals["tokens"] += samples * block

    def state_dict(self) -> dict:
        positions = dict(self.positions)
        if self.batches is not None:
            positions[self.stream] = self.batches.state_dict()
        return {"streams": positions, "consumed": {name: dict(totals) for name, totals in self.consumed.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Before the first enter(). A checkpoint from before phases holds its one reader's state."""
        if "streams" not in state:
            self.positions = {self.recipe.stream(self.recipe.phases[0]): state}
            return
        self.positions = dict(state["streams"])
        self.consumed = {name: dict(totals) for name, totals in state["consumed"].items()}

    def close(self) -> None:
        if self.batches is not None:
            self.positions[self.stream] = self.batches.state_dict()
            self.batches.close()
        self.stream = self.batches = None
