"""A converted dataset (or a mixture's sources) opened for reading: index files fetched, checked against
the metadata and the model, and its identity (a resumed run must read the very same samples)."""

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path

from tokstream.errors import UserError
from tokstream.format import METADATA_FILE, DatasetMetadata, check_compatible, read_metadata
from tokstream.reader import mixture
from tokstream.reader.batch_plan import BatchPlan
from tokstream.reader.config import DataConfig
from tokstream.reader.mixture import Source
from tokstream.reader.streaming_door.streaming_internals import shuffle_names
from tokstream.split_check import check_split, dataset_identity, former_dataset_identity


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
            if relative != METADATA_FILE and target.exists() and target.read_bytes() != temporary.read_bytes():
                temporary.unlink()
                raise stale_cache(source, relative)
            os.replace(temporary, target)
    return root


def stale_cache(source: Source, index: str) -> UserError:
    """The cache holds shards of another version of the dataset: streaming would read them as this one's (a shard
    file present in the cache is taken as downloaded)."""
    return UserError(f"the cache {source.local} holds another version of {source.remote} (its {index} differs from "
                     f"the dataset's): empty {source.local}, or give the data a cache folder of its own")


def check_local_cache(source: Source, splits: tuple[str, ...]) -> None:
    """A local dataset read through a cache of its own (streaming copies it there): the cache must be of this
    version of it."""
    if is_remote(source.remote) or not source.local or Path(source.local).resolve() == Path(source.remote).resolve():
        return
    for split in splits:
        cached, original = Path(source.local, split, "index.json"), Path(source.remote, split, "index.json")
        if cached.exists() and original.exists() and cached.read_bytes() != original.read_bytes():
            raise stale_cache(source, f"{split}/index.json")


@dataclass(frozen=True)
class Dataset:
    """The converted datasets a reader reads (one, or a mixture's sources), opened and checked."""

    config: DataConfig
    sources: list[Source]
    metadata: list[DatasetMetadata]  # per source
    identity: str  # of the train split(s): a resumed run must read the very same samples
    source_identities: tuple[str, ...] = ()  # each source's own, in sources' order
    shuffle_by_size: bool = False  # config.shuffle_algo was chosen by `auto`: a state's own order is taken instead
    # What runs recorded before 2026-11-28, each source's (split_check.former_dataset_identity).
    former_source_identities: tuple[str, ...] = ()

    @property
    def former_identity(self) -> str:
        return mixture.identity(list(self.former_source_identities))

    def reads(self, recorded_identity: str) -> bool:
        """Whether a checkpoint's or a state's recorded identity is this dataset's: its own, or the former one."""
        return recorded_identity in (self.identity, self.former_identity)

    @property
    def source_names(self) -> list[str]:
        return [source.name for source in self.sources]

    @property
    def cache_roots(self) -> list[str]:
        """Where each source's shards are read from: its cache, or a local dataset itself."""
        return [os.path.abspath(local_root(source)) for source in self.sources]

    @property
    def cache_dirs(self) -> list[str]:
        """The split directories its StreamingDatasets register in shared memory (stale_shm.py)."""
        return [os.path.join(local_root(source), split) for source in self.sources
                for split in (self.config.split, self.config.val_split)]

    def samples(self, split: str) -> list[int]:
        """The split's samples in each source (0 where a source lacks the split)."""
        return [m.splits[split].samples if split in m.splits else 0 for m in self.metadata]

    def epoch_samples(self, plan: BatchPlan) -> list[int]:
        """Each source's samples per epoch of the train split (mixture.samples_per_epoch), their sum a whole
        number of steps (plan.epoch_samples); refuses a split too small for one epoch (its ranks would wait
        forever for a batch)."""
        split, nodes = self.config.split, self.config.num_canonical_nodes
        unit = plan.epoch_unit(nodes)
        counts = mixture.samples_per_epoch(self.sources, self.samples(split), unit)
        if sum(counts) == 0:
            need = (f"one step's global_batch_size {plan.global_batch_size}" if unit == plan.global_batch_size else
                    f"{unit}, the smallest epoch of whole steps of {plan.global_batch_size} that divides over "
                    f"data.num_canonical_nodes {nodes}")
            held = (f"the {split} split has {sum(self.samples(split))} samples" if len(counts) == 1 else
                    f"the mixture's weights give an epoch of {split} fewer samples")
            raise UserError(f"{held}, fewer than {need}: convert more data or lower global_batch_size")
        return counts

    def describe_epoch(self, plan: BatchPlan) -> str:
        """One line for the start of a run: the epoch's steps and what each source gives it."""
        return mixture.describe_epoch(self.sources, self.samples(self.config.split), self.epoch_samples(plan),
                                      plan.global_batch_size)

    def token_difference(self, other: "Dataset") -> tuple | None:
        """(setting, its value here, other's) of the first way its token ids mean other things than `other`'s
        (tokenizer, vocabulary, separator and its position); None when a model reads both alike (block sizes may
        differ)."""
        return mixture.token_difference(other.metadata[0], self.metadata[0], layout=False)

    def check_resumes(self, saved_identity: str) -> None:
        """Refuse to resume on other samples than a checkpoint's (the settings that order them: the trainer's
        resume_policy.py)."""
        if not self.reads(saved_identity):
            raise UserError("the dataset differs from the one the checkpoint was trained on; use a new run_dir")


def open_dataset(config: DataConfig, vocab_size: int | None = None, block_size: int | None = None) -> Dataset:
    """Fetch each source's index files (once, when remote) and check them; refuse a dataset that does not fit
    the model (`vocab_size`, `block_size`: a model's, when given), or sources that do not fit each other."""
    if config.shuffle_algo not in (AUTO_SHUFFLE, *shuffle_names()):  # else a KeyError in a DataLoader worker
        raise UserError(f"data.shuffle_algo={config.shuffle_algo!r} is not a shuffle streaming knows: give "
                        f"{AUTO_SHUFFLE} or one of {', '.join(shuffle_names())}")
    from tokstream.reader.order import LAZY_ORDERS

    if config.shuffle_auto_lazy not in LAZY_ORDERS:
        raise UserError(f"data.shuffle_auto_lazy={config.shuffle_auto_lazy!r} is not one of the lazy orders: give "
                        f"{' or '.join(LAZY_ORDERS)}")
    sources = mixture.sources(config)
    metadata, identities, former = [], [], []
    for source in sources:
        root = fetch_index_files(source, (config.split, config.val_split))
        check_local_cache(source, (config.split, config.val_split))
        metadata.append(read_metadata(root))
        check_compatible(metadata[-1], vocab_size or metadata[-1].vocab_size, block_size or metadata[-1].block_size,
                         source.remote)
        if config.split not in metadata[-1].splits:
            raise UserError(f"{source.remote} has no {config.split} split (it has {', '.join(metadata[-1].splits)}): "
                            "set data.split")
        for split in {config.split, config.val_split} & set(metadata[-1].splits):
            check_split(root, split, metadata[-1], source.remote.rstrip("/"), local_files=not is_remote(source.remote))
        identities.append(dataset_identity(root, config.split))
        former.append(former_dataset_identity(root, config.split))
    mixture.check_same_tokens(sources, metadata)
    by_size = config.shuffle_algo == AUTO_SHUFFLE
    if by_size:
        config = dataclasses.replace(config, shuffle_algo=algo_for_size(config, [
            m.splits[config.split].samples for m in metadata]))
    return Dataset(config, sources, metadata, mixture.identity(identities), tuple(identities), by_size, tuple(former))


# data.shuffle_algo's default: each dataset's order chosen by its size (algo_for_size).
AUTO_SHUFFLE = "auto"
# What a state that does not say its shuffle was read in: streaming's default, this project's until `auto`.
OLD_DEFAULT_ALGO = "py1e"


def algo_for_size(config: DataConfig, split_samples: list[int]) -> str:
    """`auto`'s choice: streaming's py1e (its own order, kept as files when data.order_dir is set) below
    data.lazy_order_from samples in the train split, where computing it costs a node a second or so an epoch; the
    lazy order from there on, whose start-up does not grow with the data (docs/scale.md)."""
    return config.shuffle_auto_lazy if sum(split_samples) >= config.lazy_order_from else OLD_DEFAULT_ALGO


def val_split_holds_a_batch(samples: int, world_size: int, micro_batch_size: int) -> bool:
    """Whether every rank gets at least one micro-batch of a split of `samples` (streaming gives each rank
    ceil(samples / ranks) samples and the loader drops a partial batch)."""
    return math.ceil(samples / world_size) >= micro_batch_size


def vocab_size(source: Source, split: str) -> int:
    """The source's vocab_size from its metadata.json, for a loader made without an opened Dataset (a
    benchmark's): where an earlier open left it, or fetched now."""
    return _metadata(source, split).vocab_size


def split_samples(source: Source, split: str) -> int:
    """The split's samples in the source, from its metadata.json, as vocab_size reads it (0 without the split)."""
    splits = _metadata(source, split).splits
    return splits[split].samples if split in splits else 0


def _metadata(source: Source, split: str) -> DatasetMetadata:
    fetched = is_remote(source.remote) and Path(local_root(source), METADATA_FILE).is_file()
    return read_metadata(local_root(source) if fetched else fetch_index_files(source, (split,)))
