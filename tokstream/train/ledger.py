"""Which samples each rank read in a step of a run, per source, without running the model (train/ledger.py).

A step's samples are a function of the config and the step (phases.py), and which rank read which of them a
function of the ranks and nodes that ran it. The run records both: its config and the identity of each phase's
data in every checkpoint, its ranks and nodes in each step's line of metrics.jsonl. The ledger takes the newest
checkpoint's, checks that the data it finds is the data the run read, and computes each step's reads with the
reader's own order (tokstream.reader.SampleOrder): for steps the run made, whatever world sizes it was relaunched
on, and for steps it has not made yet, on the last launch's ranks.
"""

import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokstream.errors import UserError
from tokstream.object_store import is_s3
from tokstream.reader import SampleOrder
from tokstream.tokenizer import dataset_tokenizer
from tokstream.train.checkpoint import find_latest
from tokstream.train.config import TrainConfig, apply_overrides, config_from_dict
from tokstream.train.metrics import read_records
from tokstream.train.phases import Phase, Recipe, started
from tokstream.train.run_store import open_run_store


@dataclass(frozen=True)
class StepReads:
    step: int  # as metrics.jsonl and the console count them: the first step is 1
    phase: Phase
    nodes: int
    ranks: int
    recorded: bool  # ranks and nodes from the run's metrics; else the last launch's (a step not made yet)
    samples: np.ndarray  # (ranks, samples per rank): ids in the phase's data, a mixture's sources one after another


class Ledger:
    def __init__(self, config: TrainConfig, recipe: Recipe, layouts: dict[int, tuple[int, int]]):
        self.config, self.recipe, self.layouts = config, recipe, layouts
        self._orders: dict[str, SampleOrder] = {}  # per stream

    @classmethod
    def of_run(cls, run_dir: str, overrides: list[str] = ()) -> "Ledger":
        """The run's ledger: its newest usable checkpoint's config (with `overrides`, e.g. where its data lies
        on this machine) and metrics.jsonl; refuses data that is not what the run read."""
        if not is_s3(run_dir) and not Path(run_dir).is_dir():
            raise UserError(f"{run_dir} does not exist: give a run's run_dir")
        store = open_run_store(run_dir, None, check_writable=False)
        with contextlib.redirect_stdout(sys.stderr):  # the checkpoint search's warnings are not the answer
            url, saved = find_latest(store)
        if saved is None:
            raise UserError(f"{run_dir} holds no checkpoint: the ledger reads a run's config from its checkpoints")
        config = apply_overrides(config_from_dict(saved["run"]["config"]), overrides)
        recipe = Recipe.open(config, 1)
        step = saved["progress"]["step"]
        identities = saved["run"].get("phase_identities") or [saved["run"]["dataset_identity"]]
        for phase, identity in zip(recipe.phases, identities):
            found = recipe.dataset(phase).identity
            if started(phase, step) and found != identity:
                data = phase.data.remote or ", ".join(s.remote for s in phase.data.streams)
                raise UserError(f"{phase.name}'s data ({data}) is not the data the run read (identity {found}, the "
                                f"run's {identity}): point the ledger at the run's data, e.g. data.remote=PATH")
        layouts = {record["step"]: (record["nodes"], record["ranks"]) for record in read_records(run_dir)
                   if "ranks" in record}
        return cls(config, recipe, layouts)

    def layout(self, step: int, ranks: int | None = None, nodes: int | None = None) -> tuple[int, int, bool]:
        """(nodes, ranks, recorded) of `step`: given, or the run's, or for a step past its records the last."""
        if ranks is not None:
            return nodes or 1, ranks, False
        if step in self.layouts:
            return *self.layouts[step], True
        if self.layouts and step > max(self.layouts):
            return *self.layouts[max(self.layouts)], False
        raise UserError(f"the run's metrics.jsonl does not say which ranks ran step {step} (a run from before the "
                        "ledger, or a step it has no line for): give --ranks (and --nodes)")

    def step(self, step: int, ranks: int | None = None, nodes: int | None = None) -> StepReads:
        if not 1 <= step:
            raise UserError(f"step {step}: steps count from 1, as metrics.jsonl and the console do")
        nodes, ranks, recorded = self.layout(step, ranks, nodes)
        if ranks % nodes:
            raise UserError(f"{ranks} ranks do not divide over {nodes} nodes")
        phase = self.recipe.at(step - 1)
        unit = self.recipe.units[phase.index]
        read = self.order(phase).steps(self.units_before(phase, step - 1), phase.global_batch_size // unit,
                                       nodes, ranks // nodes)
        return StepReads(step, phase, nodes, ranks, recorded, read.transpose(1, 0, 2).reshape(ranks, -1))

    def units_before(self, phase: Phase, step: int) -> int:
        """How many units of `phase`'s stream the steps before `step` (0-based) took: a stream is read in the
        global batch of the first phase that reads it, and each step takes its batch's worth."""
        stream, unit = self.recipe.stream(phase), self.recipe.units[phase.index]
        taken = 0
        for other, following in zip(self.recipe.phases, self.recipe.phases[1:] + [None]):
            if self.recipe.stream(other) == stream:
                end = min(step, following.start_step) if following else step
                taken += max(0, end - other.start_step) * (other.global_batch_size // unit)
        return taken

    def order(self, phase: Phase) -> SampleOrder:
        stream = self.recipe.stream(phase)
        if stream not in self._orders:
            self._orders[stream] = SampleOrder(self.recipe.dataset(phase), self.recipe.units[phase.index])
        return self._orders[stream]

    def sources(self, phase: Phase, sample_ids: np.ndarray) -> list[tuple[str, int]]:
        """Each sample's source name and id within it."""
        sources, ids = self.order(phase).source_of(sample_ids)
        names = self.recipe.dataset(phase).source_names
        return [(names[source], int(i)) for source, i in zip(sources.tolist(), ids.tolist())]

    def texts(self, phase: Phase, sample_ids: np.ndarray) -> list[str]:
        """The samples decoded with the tokenizer their dataset was converted with."""
        dataset = self.recipe.dataset(phase)
        sources, _ = self.order(phase).source_of(sample_ids)
        tokens = self.order(phase).tokens(sample_ids)
        tokenizers = {}
        for source in set(sources.tolist()):
            tokenizers[source] = dataset_tokenizer(dataset.metadata[source], dataset.sources[source].remote)
        return [tokenizers[source].decode(row.tolist()) for source, row in zip(sources.tolist(), tokens)]

    def close(self) -> None:
        for order in self._orders.values():
            order.close()
