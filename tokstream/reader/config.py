"""The reader's settings: which converted datasets (one, or a weighted mixture), how to order and cache
them. Training's YAML holds them under `data:`."""

from dataclasses import dataclass, field


@dataclass
class StreamConfig:
    """One source of a mixture (data.streams): a converted dataset and its weight, streaming's Stream."""

    remote: str = ""  # dataset root: local path or s3://...
    local: str | None = None  # its own cache when remote; default: data.local/<name>
    name: str | None = None  # label in metrics; default: the remote's last path component
    # At most one weight, the same kind for every source. proportion: the share of each epoch, whose
    # size is all sources' samples together. repeat (x its samples) or choose (samples): per epoch.
    # None everywhere: every sample once. The epoch is cut to whole steps (mixture.py).
    proportion: float | None = None
    repeat: float | None = None
    choose: int | None = None


@dataclass
class DataConfig:
    remote: str = ""  # dataset root written by a converter: local path or s3://...; or data.streams
    local: str | None = None  # local cache for a remote; defaults to remote when that is a path
    split: str = "train"
    val_split: str = "val"
    shuffle_seed: int = 9176
    # "auto": streaming's py1e for a train split under lazy_order_from samples (kept as files: order_dir), the lazy
    # order (lazy, docs/scale.md) from there on; a run keeps the order it started in (feistel_window, the first lazy
    # order, stays for the runs and reader states read in it).
    shuffle_algo: str = "auto"
    # The lazy order `auto` takes from lazy_order_from on. Part of a run's recorded config: a run whose checkpoints
    # do not say it started before the lazy order of issue 51, when `auto` took feistel_window (resume_policy.py).
    shuffle_auto_lazy: str = "lazy"
    lazy_order_from: int = 1 << 24
    shuffle_block_size: int | None = None
    # Where streaming's epoch orders are kept as files, built once per epoch and mapped by every rank and relaunch
    # (order/order_files.py; the trainer's default: the run's orders/). None: each node's first rank
    # computes each epoch's order in memory, as stock streaming does.
    order_dir: str | None = None
    # Fixed, not derived from the cluster: the global sample order depends on it, so keeping it
    # constant is what lets a run resume on a different number of nodes and ranks.
    num_canonical_nodes: int = 1
    num_workers: int = 0  # in-process reading is far ahead of a GPU's needs; workers add to it (bench/loader.py)
    prefetch_factor: int | None = None
    predownload: int | None = None  # samples each worker prepares ahead; None: data.predownload()
    cache_limit: str | int | None = None  # bound on the local cache of a remote dataset, e.g. "10gb"
    validate_hash: str | None = "xxh64"  # check each downloaded shard against the index
    download_retry: int = 4
    clean_stale_shared_memory: bool = True
    max_documents: int = 2048  # per micro-batch, the padding of cu_seqlens when documents are asked for (documents.py)
    streams: list[StreamConfig] = field(default_factory=list)  # a mixture, instead of data.remote
