"""Which samples each rank read in a step of a run, per source, without running the model (train/ledger.py).

A step's samples are a function of the config and the step (phases.py), and which rank read which of them a
function of the ranks and nodes that ran it. The run records both: its config and the identity of each phase's
data in every checkpoint and its manifest, its ranks and nodes in each step's line of metrics.jsonl. The ledger takes the newest
checkpoint's, checks that the data it finds is the data the run read and that each recorded step's phase and
tokens are what that config gives, and computes each step's reads with the reader's own order
(tokstream.reader.SampleOrder): for steps the run made, whatever world sizes it was relaunched on, and for steps
it has not made yet, on the last launch's ranks.
"""

import contextlib
import dataclasses
import sys
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

import numpy as np

from tokstream.errors import UserError
from tokstream.object_store import is_s3
from tokstream.reader import SampleOrder, read_digest, read_sums
from tokstream.tokenizer import Tokenizer, dataset_tokenizer
from tokstream.train.checkpoint import newest_run_record
from tokstream.train.config import TrainConfig, apply_overrides, check_skips, config_from_dict
from tokstream.train.metrics import read_records
from tokstream.train.phases import Phase, Recipe, started
from tokstream.train.resume_policy import keep_run_order
from tokstream.train.run_store import open_run_store

# What the ledger may be told: where the run's data lies on this machine. Anything else would change the order.
WHERE_DATA_LIES = ("data.remote", "data.local", "data.streams.*.remote", "data.streams.*.local",
                   "phases.*.data.remote", "phases.*.data.local", "phases.*.data.streams.*.remote",
                   "phases.*.data.streams.*.local")


@dataclass(frozen=True)
class StepReads:
    step: int  # as metrics.jsonl and the console count them: the first step is 1
    phase: Phase
    nodes: int
    ranks: int
    recorded: bool  # ranks and nodes from the run's metrics; else the last launch's, or as given
    samples: np.ndarray  # (ranks, samples per rank): ids in the phase's data, a mixture's sources one after another


class Ledger:
    def __init__(self, config: TrainConfig, recipe: Recipe, records: dict[int, dict], saved_step: int):
        self.config, self.recipe, self.records, self.saved_step = config, recipe, records, saved_step
        self._orders: dict[str, SampleOrder] = {}  # per stream
        self._tokenizers: dict[tuple[int, int], Tokenizer] = {}  # per phase and source

    @classmethod
    def of_run(cls, run_dir: str, overrides: list[str] = ()) -> "Ledger":
        """The run's ledger: its newest usable checkpoint's config (with `overrides` of where its data lies on this
        machine) and metrics.jsonl; refuses data that is not what the run read."""
        if not is_s3(run_dir) and not Path(run_dir).is_dir():
            raise UserError(f"{run_dir} is not a directory: give a run's run_dir")
        for item in overrides:
            key = item.partition("=")[0].strip()
            if not any(fnmatch(key, pattern) for pattern in WHERE_DATA_LIES):
                raise UserError(f"{key}: the ledger reads the run's own settings and may only be told where its data "
                                f"lies ({', '.join(WHERE_DATA_LIES)})")
        store = open_run_store(run_dir, None, check_writable=False)
        with contextlib.redirect_stdout(sys.stderr):  # the checkpoint search's warnings are not the answer
            step, run = newest_run_record(store)
        if run is None:
            raise UserError(f"{run_dir} holds no checkpoint: the ledger reads a run's config from its checkpoints")
        config = keep_run_order(apply_overrides(config_from_dict(run["config"]), overrides), run["config"])
        records = {record["step"]: record for record in read_records(run_dir)}
        config = with_recorded_skips(config, records)
        try:
            recipe = Recipe.open(config, 1, keep_orders=False)  # it writes nothing, the run's orders/ included
        except UserError as err:
            raise UserError(f"{err} (the ledger opens every phase's data: give where it lies here, e.g. "
                            "data.remote=PATH or phases.N.data.remote=PATH)") from None
        identities = run.get("phase_identities") or [run["dataset_identity"]]
        for phase, identity in zip(recipe.phases, identities):
            found = recipe.dataset(phase).identity
            if started(phase, step) and not recipe.dataset(phase).reads(identity):
                data = phase.data.remote or ", ".join(s.remote for s in phase.data.streams)
                raise UserError(f"{phase.name}'s data ({data}) is not the data the run read (identity {found}, the "
                                f"run's {identity}): point the ledger at the run's data, e.g. data.remote=PATH")
        return cls(config, recipe, records, step)

    def layout(self, step: int, ranks: int | None = None, nodes: int | None = None) -> tuple[int, int, bool]:
        """(nodes, ranks, recorded) of `step`: given, or the run's, or for a step past its records the last."""
        if ranks is not None:
            return nodes or 1, ranks, False
        if step in self.records and "ranks" in self.records[step]:
            return self.records[step]["nodes"], self.records[step]["ranks"], True
        laid_out = [s for s, record in self.records.items() if "ranks" in record]
        if laid_out and step > max(self.records):
            return self.records[max(laid_out)]["nodes"], self.records[max(laid_out)]["ranks"], False
        raise UserError(f"the run's metrics.jsonl does not say which ranks ran step {step} (a run from before the "
                        "ledger, or a step it has no line for): give --ranks (and --nodes)")

    def step(self, step: int, ranks: int | None = None, nodes: int | None = None) -> StepReads:
        if step < 1:
            raise UserError(f"step {step}: steps count from 1, as metrics.jsonl and the console do")
        if (ranks is not None and ranks < 1) or (nodes is not None and (nodes < 1 or ranks is None)):
            raise UserError("--ranks must be a positive number, and --nodes (1 or more) comes with --ranks")
        nodes, ranks, recorded = self.layout(step, ranks, nodes)
        phase = self.recipe.at(step - 1)
        self.check_recorded(step, phase)
        unit = self.recipe.units[phase.index]
        if ranks % nodes or unit % ranks:
            raise UserError(f"step {step} reads its data in global batches of {unit} samples, which {ranks} ranks on "
                            f"{nodes} node{'s' * (nodes > 1)} do not share evenly")
        read = self.order(phase).steps(self.recipe.read_units_before(phase, step - 1), phase.global_batch_size // unit,
                                       nodes, ranks // nodes)
        said, gives = self.records.get(step, {}).get("read"), read_digest(read_sums(read))
        if said is not None and said != gives:
            raise UserError(f"step {step}: metrics.jsonl records reading other samples than the order gives for it "
                            f"(read {said}, the order {gives}): the data or its order changed since the run read it; "
                            "the ledger cannot say what it read")
        return StepReads(step, phase, nodes, ranks, recorded, read.transpose(1, 0, 2).reshape(ranks, -1))

    def check_recorded(self, step: int, phase: Phase) -> None:
        """A step the run recorded must have trained the phase, the tokens and the data this config gives it: a
        launch after the newest checkpoint may have run with phases edited, and no checkpoint holds its config."""
        record = self.records.get(step)
        if record is None or "tokens" not in record:
            return
        said = (record.get("phase", 0), record["tokens"], record.get("data", self.recipe.data_digest(phase)))
        gives = (phase.index, self.recipe.tokens_before(step), self.recipe.data_digest(phase))
        if said != gives:
            raise UserError(f"step {step}: metrics.jsonl says it trained phases.{said[0]} with {said[1]:,} tokens "
                            f"done on data {said[2]}, the config of the newest checkpoint (step {self.saved_step}) "
                            f"gives phases.{gives[0]} with {gives[1]:,} on data {gives[2]}: a launch since ran another "
                            "config, which no checkpoint holds")

    def order(self, phase: Phase) -> SampleOrder:
        stream = self.recipe.stream(phase)
        if stream not in self._orders:
            try:
                self._orders[stream] = SampleOrder(self.recipe.dataset(phase), self.recipe.units[phase.index])
            except UserError as err:
                if "Reused local directory" not in str(err):  # streaming's word for a cache a live reader uses
                    raise
                raise UserError(f"{phase.name}'s data cache is in use by a running reader (the run itself?): give the "
                                f"ledger a cache of its own, e.g. {self._cache_setting(phase)}=DIR") from None
        return self._orders[stream]

    def _cache_setting(self, phase: Phase) -> str:
        """The setting that places `phase`'s cache: that of the last phase up to it to set one, else data.local
        (under which a phase that names its data without a cache has its own)."""
        for index in range(phase.index, -1, -1) if self.config.phases else ():
            given = self.config.phases[index].data
            if given.local is not None:
                return f"phases.{index}.data.local"
            if given.remote or given.streams:
                break
        return "data.local"

    def sources(self, phase: Phase, sample_ids: np.ndarray) -> list[tuple[str, int]]:
        """Each sample's source name and id within it."""
        sources, ids = self.order(phase).source_of(sample_ids)
        names = self.recipe.dataset(phase).source_names
        return [(names[source], int(i)) for source, i in zip(sources.tolist(), ids.tolist())]

    def texts(self, phase: Phase, sample_ids: np.ndarray, tokenizer: str | None = None,
              ranks_file: str | None = None) -> list[str]:
        """The samples decoded with the tokenizer their dataset was converted with (or `tokenizer`)."""
        dataset = self.recipe.dataset(phase)
        sources, _ = self.order(phase).source_of(sample_ids)
        for source in set(sources.tolist()) - {s for p, s in self._tokenizers if p == phase.index}:
            self._tokenizers[phase.index, source] = dataset_tokenizer(
                dataset.metadata[source], dataset.sources[source].remote, tokenizer, ranks_file)
        tokens = self.order(phase).tokens(sample_ids)
        return [self._tokenizers[phase.index, source].decode(row.tolist()) for source, row in zip(sources.tolist(), tokens)]

    def close(self) -> None:
        for order in self._orders.values():
            order.close()


def with_recorded_skips(config: TrainConfig, records: dict[int, dict]) -> TrainConfig:
    """The config with the skips metrics.jsonl records as done (a launch after the newest checkpoint may have begun
    one that no checkpoint's config holds yet): what the run read, not only what its newest checkpoint says."""
    done = [record["skipped"].get("steps") for record in records.values() if isinstance(record.get("skipped"), dict)]
    skips = sorted({tuple(pair) for pair in [*config.skip_steps, *done] if isinstance(pair, list) and len(pair) == 2})
    if [list(pair) for pair in skips] == config.skip_steps:
        return config
    check_skips([list(pair) for pair in skips])  # one that overlaps the config's is refused, naming both
    return dataclasses.replace(config, skip_steps=[list(pair) for pair in skips])
