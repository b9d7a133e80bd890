"""Training data: the converters' MDS datasets through StreamingDataset and StreamingDataLoader.

Partitioning over ranks and workers, shuffling, mixing sources, download-ahead and resumption are
streaming's; this module only chooses the arguments (one Stream per source: mixture.py), checks
that a resumed run reads the same sample order. Batches come from TokenDataset.get_batch
(token_dataset.py) and reach the rank through TokenLoader (token_loader.py).
"""

import hashlib
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from streaming import Stream

from tokstream.errors import UserError
from tokstream.format import (METADATA_FILE, DatasetMetadata, check_compatible, read_metadata, shard_sample_count,
                              stored_file)
from tokstream.train import mixture
from tokstream.train.batch_plan import BatchPlan
from tokstream.train.config import DataConfig
from tokstream.train.mixture import Source
from tokstream.train.token_dataset import TokenDataset, damaged_shard, sample_count_problem
from tokstream.train.token_loader import TokenLoader


def is_remote(path: str) -> bool:
    return "://" in path


def local_root(source: Source) -> str:
    """Where StreamingDataset keeps (or, for a local dataset, finds) the source's shards."""
    if is_remote(source.remote):
        if not source.local:
            setting = "data.local" if source.key == "data.remote" else f"{source.key}.local (or data.local)"
            raise UserError(f"{source.where}={source.remote} is remote: set {setting} to a local cache directory")
        return source.local
    if not Path(source.remote).is_dir():
        raise UserError(f"{source.where}={source.remote} does not exist; convert a dataset first "
                        "(python convert/owt_to_mds.py --out ...)")
    return source.local or source.remote


def cache_dirs(config: DataConfig) -> list[str]:
    """The split directories StreamingDataset registers in shared memory for this run."""
    return [os.path.join(local_root(source), split) for source in mixture.sources(config)
            for split in (config.split, config.val_split)]


def fetch_index_files(source: Source, splits: tuple[str, ...]) -> Path:
    """The directory holding the source's metadata.json and each split's index.json, downloaded first
    if remote.

    Every rank downloads its own copy under a unique name and renames it into place, so ranks
    sharing a node never read a half-written file.
    """
    if not is_remote(source.remote):
        local_root(source)  # checks that it exists
        return Path(source.remote)
    if not source.remote.startswith("s3://"):
        raise UserError(f"{source.where}={source.remote}: only local paths and s3:// are supported")
    from tokstream.object_store import S3Dataset

    store = S3Dataset(source.remote)
    root = Path(local_root(source))
    if not store.exists(METADATA_FILE):
        raise UserError(f"{source.remote} has no {METADATA_FILE}: not a converted dataset, or its conversion "
                        "has not finished")
    if not store.exists(f"{splits[0]}/index.json"):
        raise UserError(f"{source.remote}/{splits[0]}/index.json is missing: the split's conversion never "
                        "finished, or data.split names a split the dataset lacks")
    for relative in [METADATA_FILE] + [f"{s}/index.json" for s in splits]:
        if relative == METADATA_FILE or store.exists(relative):
            target = root / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            temporary = target.with_name(f"{target.name}.{os.getpid()}.tmp")
            store.download(relative, temporary)
            os.replace(temporary, target)
    return root


def check_split(root: Path, split: str, metadata: DatasetMetadata, dataset: str, local_files: bool) -> None:
    """A split's index.json against the metadata's count and, with `local_files` (a local dataset), every
    shard it names against the file: its size (hashes are convert/verify.py's job) and, uncompressed, the
    sample count in its header (4 bytes read; a compressed shard's is checked when the reader maps it).
    A stale count is named here, not found as epochs of repeats or an IndexError deep in a reader."""
    index = root / split / "index.json"
    if not index.is_file():
        raise UserError(f"{index} is missing: the {split} split's conversion never finished; reconvert it")
    try:
        shards = json.loads(index.read_text())["shards"]
        indexed = sum(shard["samples"] for shard in shards)
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise UserError(f"{index} is damaged ({type(err).__name__}: {err}); reconvert the split") from None
    if metadata.splits[split].samples != indexed:
        raise UserError(f"{dataset}/{METADATA_FILE} says the {split} split has {metadata.splits[split].samples} "
                        f"samples, its index.json {indexed}: one of them is stale or hand-edited; python "
                        f"convert/verify.py {dataset} checks the dataset, reconverting repairs it")
    if not local_files:  # remote shards are checked against their hashes as they arrive, and when mapped
        return
    for shard in shards:
        stored = stored_file(shard)
        path = root / split / stored["basename"]
        size = path.stat().st_size if path.is_file() else None
        if size != stored["bytes"]:
            raise UserError(damaged_shard(path, "is missing" if size is None else
                                          f"has {size} bytes, the index says {stored['bytes']}", dataset))
        if shard["zip_data"] is None and (problem := sample_count_problem(shard_sample_count(path), shard["samples"])):
            raise UserError(damaged_shard(path, problem, dataset))


def dataset_identity(root: Path, split: str) -> str:
    """Digest of the metadata and the split's index: a resumed run must see the very same samples."""
    digest = hashlib.sha256(Path(root, METADATA_FILE).read_bytes())
    digest.update(Path(root, split, "index.json").read_bytes())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class TrainingDataset:
    """The converted datasets training reads (one, or a mixture's sources), as training sees them."""

    sources: list[Source]
    metadata: list[DatasetMetadata]  # per source
    identity: str  # of the train split(s): a resumed run must read the very same samples

    def samples(self, split: str) -> list[int]:
        """The split's samples in each source (0 where a source lacks the split)."""
        return [m.splits[split].samples if split in m.splits else 0 for m in self.metadata]


def open_dataset(config: DataConfig, vocab_size: int, block_size: int) -> TrainingDataset:
    """Fetch each source's index files (once, when remote) and refuse a dataset that does not fit the model,
    or sources that do not fit each other."""
    sources = mixture.sources(config)
    metadata, identities = [], []
    for source in sources:
        root = fetch_index_files(source, (config.split, config.val_split))
        metadata.append(read_metadata(root))
        check_compatible(metadata[-1], vocab_size, block_size, source.remote)
        if config.split not in metadata[-1].splits:
            raise UserError(f"{source.remote} has no {config.split} split (it has {', '.join(metadata[-1].splits)}): "
                            "set data.split")
        for split in {config.split, config.val_split} & set(metadata[-1].splits):
            check_split(root, split, metadata[-1], source.remote.rstrip("/"), local_files=not is_remote(source.remote))
        identities.append(dataset_identity(root, config.split))
    mixture.check_same_tokens(sources, metadata)
    return TrainingDataset(sources, metadata, mixture.identity(identities))


def train_epoch_samples(dataset: TrainingDataset, split: str, plan: BatchPlan, num_canonical_nodes: int) -> list[int]:
    """Each source's samples per epoch (mixture.samples_per_epoch), their sum a whole number of steps
    (plan.epoch_samples); refuses a split too small for one epoch (its ranks would wait forever for a batch)."""
    unit = plan.epoch_unit(num_canonical_nodes)
    counts = mixture.samples_per_epoch(dataset.sources, dataset.samples(split), unit)
    if sum(counts) == 0:
        need = (f"one step's global_batch_size {plan.global_batch_size}" if unit == plan.global_batch_size else
                f"{unit}, the smallest epoch of whole steps of {plan.global_batch_size} that divides over "
                f"data.num_canonical_nodes {num_canonical_nodes}")
        held = (f"the {split} split has {sum(dataset.samples(split))} samples" if len(counts) == 1 else
                f"the mixture's weights give an epoch of {split} fewer samples")
        raise UserError(f"{held}, fewer than {need}: convert more data or lower global_batch_size")
    return counts


def val_split_holds_a_batch(samples: int, world_size: int, micro_batch_size: int) -> bool:
    """Whether every rank gets at least one micro-batch of a split of `samples` (streaming gives each rank
    ceil(samples / ranks) samples and the loader drops a partial batch)."""
    return math.ceil(samples / world_size) >= micro_batch_size


def check_same_dataset(saved_identity: str, dataset: TrainingDataset) -> None:
    """Refuse to resume on other samples (the settings that order them: resume_policy.py)."""
    if saved_identity != dataset.identity:
        raise UserError("the dataset differs from the one the checkpoint was trained on; use a new run_dir")


class TrainBatches:
    """The train split's micro-batches, epoch after epoch, with the loader's position as its state."""

    def __init__(self, config: DataConfig, micro_batch_size: int, epoch_samples: list[int], pin_memory: bool):
        self.loader = make_loader(config, config.split, micro_batch_size, shuffle=True, pin_memory=pin_memory,
                                  choose=epoch_samples, reuse_slots=True)
        self._first_sample_of_source = self.loader.dataset.sample_offset_per_stream
        # No reference back to self: a cycle would keep the loader's workers alive past the run.
        self._batches = _epoch_after_epoch(self.loader)

    def samples_per_source(self, sample_ids: list[int]) -> np.ndarray:
        """How many of these samples each source gave."""
        sources = np.searchsorted(self._first_sample_of_source, sample_ids, side="right") - 1
        return np.bincount(sources, minlength=len(self._first_sample_of_source))

    def __next__(self) -> dict[str, torch.Tensor]:
        return next(self._batches)

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)


def _epoch_after_epoch(loader: TokenLoader) -> Iterator[dict[str, torch.Tensor]]:
    while True:  # streaming starts the next epoch on each new iterator
        yield from loader


# Streaming's own default, 8 x the batch, caps a reader: once its ready thread is that far ahead it
# sleeps a 7 ms tick, so at batch 16 at most 128 samples pass per tick (about 18 M tokens/s, measured
# 16 M by bench/loader.py). 2,048 samples lift the cap past 290 k samples/s. With a cache_limit the
# download-ahead must also fit the cache, so streaming's default stays.
MIN_PREDOWNLOAD = 2048


def predownload(config: DataConfig, batch_size: int) -> int:
    if config.predownload is not None:
        return config.predownload
    return 8 * batch_size if config.cache_limit else max(8 * batch_size, MIN_PREDOWNLOAD)


def vocab_size(source: Source, split: str) -> int:
    """The source's vocab_size from its metadata.json: where open_dataset left it, or fetched now by a
    loader made without it (a benchmark's)."""
    fetched = is_remote(source.remote) and Path(local_root(source), METADATA_FILE).is_file()
    return read_metadata(local_root(source) if fetched else fetch_index_files(source, (split,))).vocab_size


def make_loader(config: DataConfig, split: str, batch_size: int, shuffle: bool, pin_memory: bool,
                num_workers: int | None = None, choose: list[int] | None = None,
                sources: list[Source] | None = None, reuse_slots: bool = False) -> TokenLoader:
    """A loader over the split of every source (or of `sources`), each giving `choose[i]` samples an
    epoch (default: each of its samples once). `reuse_slots`: see TokenLoader."""
    sources = mixture.sources(config) if sources is None else sources
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
            shuffle_seed=config.shuffle_seed, shuffle_algo=config.shuffle_algo,
            shuffle_block_size=config.shuffle_block_size, num_canonical_nodes=config.num_canonical_nodes,
            batch_size=batch_size, cache_limit=config.cache_limit,
            predownload=predownload(config, batch_size), download_retry=config.download_retry,
            vocab_sizes=[vocab_size(source, split) for source in sources],
        )
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
