"""Micro-batches of B + 1 tokens: the converters' MDS datasets through StreamingDataset and
StreamingDataLoader.

Partitioning over ranks and workers, shuffling, mixing sources, download-ahead and resumption are
streaming's; this module only chooses the arguments (one Stream per source: mixture.py). Batches
come from TokenDataset.get_batch (token_dataset.py) and reach the rank through TokenLoader
(token_loader.py).
"""

import os
import warnings
from collections.abc import Iterator

import numpy as np
import torch

from tokstream.reader.streaming_door.streaming_import import import_streaming

import_streaming()  # before streaming is imported: without transformers and torchvision (streaming_import.py)
from streaming import Stream

from tokstream.errors import UserError
from tokstream.reader import mixture
from tokstream.reader.config import DataConfig
from tokstream.reader.batch_plan import BatchPlan
from tokstream.reader.dataset import (AUTO_SHUFFLE, OLD_DEFAULT_ALGO, Dataset, algo_for_size, is_remote, local_root,
                                      split_samples, val_split_holds_a_batch, vocab_size)
from tokstream.reader.documents import document_structure
from tokstream.reader.mixture import Source
from tokstream.reader.token_dataset import TokenDataset
from tokstream.reader.streaming_door.streaming_internals import shuffle_names
from tokstream.reader.token_loader import TokenLoader


class TrainBatches:
    """This rank's micro-batches of the train split, epoch after epoch, with their position as its state.

    Each is a dict: "tokens", (micro_batch_size, block_size + 1) in the dataset's dtype (uint16 for
    GPT-2; to_device makes inputs and targets of it), "ids", the samples' ids in the dataset (a
    mixture's sources one after another), and with `with_sources`, "source", each sample's source index
    (Dataset.source_names). The rank and world come from torchrun's environment (RANK, WORLD_SIZE,
    LOCAL_WORLD_SIZE), as streaming reads them; the plan's world_size must be that WORLD_SIZE. Every
    step's samples are a function of the dataset, its settings, the global batch and the step alone:
    state_dict() taken between any two micro-batches resumes with the next one, on any world size and
    micro-batch that cut the same global batch.

    `reuse_buffers` (with DataLoader workers): workers write into a shared ring the rank reads in place,
    so a micro-batch's tensors are overwritten about two transfers (512 samples) later; for a loop that
    copies each micro-batch to the device before it takes the next (tokstream's trainer). Off: every
    micro-batch is its own. `pin_memory` without CUDA is turned off with a warning, as torch's DataLoader does.
    `max_documents`: each micro-batch also holds its documents, "positions", "documents" and "cu_seqlens"
    padded to max_documents + 1 (documents.py).
    """

    def __init__(self, dataset: Dataset, plan: BatchPlan, pin_memory: bool = False, with_sources: bool = False,
                 reuse_buffers: bool = False, max_documents: int | None = None):
        world = int(os.environ.get("WORLD_SIZE", 1))
        if plan.world_size != world:
            raise UserError(f"the batch plan is for {plan.world_size} ranks, but this process is one of {world} "
                            "(WORLD_SIZE): give BatchPlan the world size torchrun started")
        if pin_memory and not torch.cuda.is_available():
            warnings.warn("pin_memory=True without CUDA: micro-batches are not pinned", stacklevel=2)
            pin_memory = False
        config = dataset.config
        self.epoch_samples = dataset.epoch_samples(plan)  # per source
        self._of = order_of(dataset, plan)
        self._shuffle_by_size = dataset.shuffle_by_size
        self._reads = dataset.reads
        self.loader = make_loader(config, config.split, plan.micro_batch_size, shuffle=True, pin_memory=pin_memory,
                                  choose=self.epoch_samples, sources=dataset.sources, reuse_slots=reuse_buffers,
                                  vocab_sizes=[m.vocab_size for m in dataset.metadata])
        self._first_sample_of_source = self.loader.dataset.sample_offset_per_stream
        # No reference back to self: a cycle would keep the loader's workers alive past the run.
        self._batches = _epoch_after_epoch(self.loader, self._first_sample_of_source if with_sources else None,
                                           _documents_adder(dataset, max_documents))
        self._started = self._closed = False

    def samples_per_source(self, sample_ids: list[int]) -> np.ndarray:
        """How many of these samples each source gave."""
        return np.bincount(_source_of(self._first_sample_of_source, np.asarray(sample_ids, dtype=np.int64)),
                           minlength=len(self._first_sample_of_source))

    def __iter__(self) -> "TrainBatches":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._closed:
            raise UserError("these TrainBatches are closed: make new ones (and load_state_dict) to read on")
        self._started = True
        return next(self._batches)

    def state_dict(self) -> dict:
        """Where the next micro-batch is, for every rank (rank 0's is enough to save), and what decides the order
        it is a position in (STATE_FORMAT)."""
        if self._closed:
            return self._closed_state
        return {"format": STATE_FORMAT, **self._of, "position": self.loader.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a state_dict() of batches in the same order (the same data, weights, global batch, shuffle
        and block), before the first batch is taken; any other state is refused in one line."""
        if self._started:
            raise UserError("load_state_dict must come before the first micro-batch is taken")
        if self._shuffle_by_size:  # data.shuffle_algo: auto keeps the order the state was read in
            saved = state.get("shuffle_algo", OLD_DEFAULT_ALGO) if isinstance(state, dict) else None
            if saved in shuffle_names() and saved != self._of["shuffle_algo"]:
                self._of["shuffle_algo"] = self.loader.dataset.shuffle_algo = saved
        if isinstance(state, dict) and self._reads(state.get("dataset_identity")):
            state = {**state, "dataset_identity": self._of["dataset_identity"]}  # the former identity of these samples
        self.loader.load_state_dict(checked_position(state, self._of, sum(self.epoch_samples)))

    def close(self) -> None:
        """End the epoch's iterator: its DataLoader workers exit, its shared ring is unmapped and its shared
        memory released; state_dict() still says where it stopped."""
        if self._closed:
            return
        self._closed_state = self.state_dict()
        self._closed = True
        self._batches.close()
        self.loader.dataset.release_shared_memory()


# What TrainBatches.state_dict() returns: "format", what decides the order (order_of), and "position", streaming's
# own state. Two older forms are still read: the same without "format" and with only dataset_identity and
# global_batch_size (2026, before the weights and shuffle were kept), and streaming's position alone (tokstream's
# trainer before the reader API).
STATE_FORMAT = "tokstream.reader.TrainBatches/2"
STREAMING_POSITION = {"epoch", "sample_in_epoch", "num_canonical_nodes", "shuffle_seed", "initial_physical_nodes"}
# What each key of order_of() is called in a refusal.
ORDER_WORDS = {"dataset_identity": "dataset", "global_batch_size": "global_batch_size", "weights": "mixture weights",
               "shuffle_seed": "data.shuffle_seed", "shuffle_algo": "data.shuffle_algo",
               "shuffle_block_size": "data.shuffle_block_size", "num_canonical_nodes": "data.num_canonical_nodes",
               "block_size": "block size"}


def order_of(dataset: Dataset, plan: BatchPlan) -> dict:
    """Everything that decides which sample comes at which position of a reader's order."""
    config = dataset.config
    return {"dataset_identity": dataset.identity, "global_batch_size": plan.global_batch_size,
            "weights": [[source.weight, source.value] for source in dataset.sources],
            "shuffle_seed": config.shuffle_seed, "shuffle_algo": config.shuffle_algo,
            "shuffle_block_size": config.shuffle_block_size, "num_canonical_nodes": config.num_canonical_nodes,
            "block_size": dataset.metadata[0].block_size}


def checked_position(state: object, order: dict, epoch_size: int) -> dict:
    """Streaming's position from a state of batches in `order` (epochs of `epoch_size` samples); one line refusing
    anything else."""
    if not isinstance(state, dict) or not ("position" in state or set(state) == STREAMING_POSITION):
        keys = f"keys {', '.join(map(repr, state))}" if isinstance(state, dict) else f"a {type(state).__name__}"
        raise UserError(f"this is not a TrainBatches state ({keys}): give what TrainBatches.state_dict() returned "
                        "(a tokstream trainer's checkpoint holds its streams' states under ['loader']['streams'])")
    if "position" in state:
        if state.get("format", STATE_FORMAT) != STATE_FORMAT:
            raise UserError(f"the state's format is {state['format']!r}, not {STATE_FORMAT!r}: it was written by "
                            "another version of tokstream's reader")
        kept = order if "format" in state else {key: order[key] for key in ("dataset_identity", "global_batch_size")}
        saved, position = {key: state.get(key) for key in kept}, state["position"]
    else:  # streaming's position alone: whole steps only (the trainer saved it between steps)
        saved, position = {}, state
        if not isinstance(position["sample_in_epoch"], int) or position["sample_in_epoch"] % order["global_batch_size"]:
            raise UserError(f"the position (sample {position['sample_in_epoch']} of its epoch) is not at a step of "
                            f"global_batch_size {order['global_batch_size']}: it cannot resume these batches")
    if not isinstance(position, dict) or not STREAMING_POSITION <= set(position):
        raise UserError("the state's position is damaged (it lacks streaming's epoch and sample_in_epoch): it cannot "
                        "resume these batches")
    epoch, sample = position["epoch"], position["sample_in_epoch"]
    whole = all(isinstance(v, int) and not isinstance(v, bool) for v in (epoch, sample))
    # Epoch -1 at sample 0: streaming's state of a reader that has read nothing yet.
    if not whole or epoch < -1 or sample < 0 or sample > epoch_size or (epoch == -1 and sample):
        raise UserError(f"the state's position is damaged (epoch {epoch!r}, sample {sample!r} of an epoch of "
                        f"{epoch_size}): it cannot resume these batches")
    # The position itself carries streaming's seed and canonical nodes, which stock streaming would silently adopt.
    checked = [*saved.items(), *((key, position[key]) for key in ("shuffle_seed", "num_canonical_nodes"))]
    for key, value in checked:
        if value != order[key] or type(value) is not type(order[key]):
            raise UserError(f"the state is of another {ORDER_WORDS[key]} ({value!r}, here {order[key]!r}): it cannot "
                            "resume these batches")
    return position


def _source_of(first_sample_of_source: np.ndarray, sample_ids: np.ndarray) -> np.ndarray:
    return np.searchsorted(first_sample_of_source, sample_ids, side="right") - 1


_WARNED_MAX_DOCUMENTS: set[int] = set()


def _documents_adder(dataset: Dataset, max_documents: int | None):
    """A function that adds a micro-batch's documents (documents.py) to it, or None."""
    if max_documents is None:
        return None
    if not isinstance(max_documents, int) or isinstance(max_documents, bool) or max_documents < 1:
        raise UserError(f"max_documents must be a positive whole number, got {max_documents!r}")
    metadata = dataset.metadata[0]  # a mixture's sources share their separator (mixture.check_same_tokens)

    def add_documents(batch: dict) -> None:
        batch.update(document_structure(batch["tokens"].numpy(), metadata.separator_id, metadata.separator_position,
                                        max_documents))
        if batch["document_count"] > max_documents and max_documents not in _WARNED_MAX_DOCUMENTS:
            _WARNED_MAX_DOCUMENTS.add(max_documents)  # once per process, not per reader (a run opens several)
            warnings.warn(f"a micro-batch holds {int(batch['document_count'])} documents, more than max_documents "
                          f"{max_documents}: its cu_seqlens merges the last ones (raise data.max_documents)",
                          stacklevel=2)
    return add_documents


def _epoch_after_epoch(loader: TokenLoader, first_sample_of_source: np.ndarray | None, add_documents=None
                       ) -> Iterator[dict[str, torch.Tensor]]:
    while True:  # streaming starts the next epoch on each new iterator
        for batch in loader:
            if first_sample_of_source is not None:
                batch["source"] = torch.from_numpy(_source_of(first_sample_of_source, batch["ids"].numpy()))
            if add_documents is not None:
                add_documents(batch)
            yield batch


class _WithDocuments:
    """An evaluation loader whose micro-batches hold their documents too."""

    def __init__(self, loader: TokenLoader, add_documents):
        self.loader, self.add_documents = loader, add_documents

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for batch in self.loader:
            self.add_documents(batch)
            yield batch


def eval_batches(dataset: Dataset, micro_batch_size: int, world_size: int, pin_memory: bool = False,
                 max_documents: int | None = None) -> tuple[dict[str, Iterator], list[str]]:
    """A loader over each source's val split (data.val_split), unshuffled, every rank its own part, for the
    sources whose split gives every rank a micro-batch; and a line for each source left out. `max_documents`:
    as TrainBatches'."""
    split = dataset.config.val_split
    loaders, left_out = {}, []
    for source, metadata, samples in zip(dataset.sources, dataset.metadata, dataset.samples(split)):
        if val_split_holds_a_batch(samples, world_size, micro_batch_size):
            loaders[source.name] = make_loader(dataset.config, split, micro_batch_size, shuffle=False,
                                               pin_memory=pin_memory, num_workers=0, sources=[source],
                                               vocab_sizes=[metadata.vocab_size])
            if max_documents is not None:
                loaders[source.name] = _WithDocuments(loaders[source.name], _documents_adder(dataset, max_documents))
        elif samples:
            left_out.append(f"evaluation of {source.where} is off: its {split} split has {samples} samples, fewer "
                            f"than one micro-batch of {micro_batch_size} on each of {world_size} ranks")
    return loaders, left_out


# Streaming's own default, 8 x the batch, caps a reader: once its ready thread is that far ahead it
# sleeps a 7 ms tick, so at batch 16 at most 128 samples pass per tick (about 18 M tokens/s, measured
# 16 M by bench/loader.py). 2,048 samples lift the cap past 290 k samples/s. With a cache_limit the
# download-ahead must also fit the cache, so streaming's default stays.
MIN_PREDOWNLOAD = 2048


def predownload(config: DataConfig, batch_size: int) -> int:
    if config.predownload is not None:
        return config.predownload
    return 8 * batch_size if config.cache_limit else max(8 * batch_size, MIN_PREDOWNLOAD)


def make_loader(config: DataConfig, split: str, batch_size: int, shuffle: bool, pin_memory: bool,
                num_workers: int | None = None, choose: list[int] | None = None,
                sources: list[Source] | None = None, reuse_slots: bool = False,
                vocab_sizes: list[int] | None = None) -> TokenLoader:
    """A loader over the split of every source (or of `sources`), each giving `choose[i]` samples an
    epoch (default: each of its samples once). `reuse_slots`: see TokenLoader. `vocab_sizes`: per source,
    an opened Dataset's; read from each source's metadata.json if not given (a benchmark's loader)."""
    sources = mixture.sources(config) if sources is None else sources
    algo = config.shuffle_algo
    if algo == AUTO_SHUFFLE:  # an opened Dataset's config says its choice; a loader made without one chooses alike
        algo = algo_for_size(config, [split_samples(source, split) for source in sources])
    streams = []
    for index, source in enumerate(sources):
        # A remote (or a local dataset with a separate local cache) is downloaded/copied by streaming.
        remote = source.remote if is_remote(source.remote) or source.local else None
        streams.append(Stream(remote=remote, local=local_root(source), split=split,
                              choose=None if choose is None else choose[index],
                              validate_hash=config.validate_hash if remote else None))
    try:
        dataset = TokenDataset(
            streams=streams, shuffle=shuffle,
            shuffle_seed=config.shuffle_seed, shuffle_algo=algo,
            shuffle_block_size=config.shuffle_block_size, num_canonical_nodes=config.num_canonical_nodes,
            batch_size=batch_size, cache_limit=config.cache_limit,
            predownload=predownload(config, batch_size), download_retry=config.download_retry,
            vocab_sizes=vocab_sizes or [vocab_size(source, split) for source in sources],
        )
        dataset.order_dir = config.order_dir if shuffle else None
    except ValueError as err:  # streaming's word on a bad setting, e.g. a cache_limit below 4 shards
        raise UserError(f"data ({split}): {err}") from None
    workers = config.num_workers if num_workers is None else num_workers
    return TokenLoader(dataset, batch_size, workers, pin_memory, reuse_slots=reuse_slots,
                       prefetch_factor=config.prefetch_factor if workers else None,
                       persistent_workers=False)


_SIGNED_OF_SAME_WIDTH = {torch.uint16: torch.int16, torch.uint32: torch.int32}


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets on the device as int64, from the B + 1 token samples.

    Tokens cross in their stored width. They are widened on the device through a signed view of
    the same bits and a mask, because torch's uint16/uint32 have only partial kernel support.
    """
    tokens = batch["tokens"]
    signed = _SIGNED_OF_SAME_WIDTH.get(tokens.dtype)
    if signed is None:
        wide = tokens.to(device, non_blocking=True).long()
    else:
        mask = (1 << (8 * tokens.element_size())) - 1
        wide = tokens.view(signed).to(device, non_blocking=True).long() & mask
    return wide[:, :-1], wide[:, 1:]
