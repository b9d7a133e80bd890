"""Training data: the converters' MDS datasets through StreamingDataset and StreamingDataLoader.

Partitioning over ranks and workers, shuffling, download-ahead and resumption are streaming's;
this module only chooses the arguments, adds the global sample id to each sample (for tracing
and tests), and collates uint16 tokens without widening them on the host.
"""

import hashlib
import os
import signal
import time
from pathlib import Path

import numpy as np
import torch
from streaming import StreamingDataLoader, StreamingDataset
from streaming.base.constant import TICK
from streaming.base.dataset import _ShardState

from config import DataConfig
from tokstream.errors import UserError
from tokstream.format import METADATA_FILE, shard_samples

_LOCAL = int(_ShardState.LOCAL)  # plain ints: IntEnum comparisons are slow per sample
_REMOTE = int(_ShardState.REMOTE)


def is_remote(path: str) -> bool:
    return "://" in path


def local_root(config: DataConfig) -> str:
    """Where StreamingDataset keeps (or, for a local dataset, finds) the shards."""
    if is_remote(config.remote):
        if not config.local:
            raise UserError(f"data.remote={config.remote} is remote: set data.local to a local cache directory")
        return config.local
    if not Path(config.remote).is_dir():
        raise UserError(f"data.remote={config.remote} does not exist; convert a dataset first "
                        "(python convert/owt_to_mds.py --out ...)")
    return config.local or config.remote


def cache_dirs(config: DataConfig) -> list[str]:
    """The split directories StreamingDataset registers in shared memory for this run."""
    root = local_root(config)
    return [os.path.join(root, split) for split in (config.split, config.val_split)]


def fetch_index_files(config: DataConfig) -> Path:
    """The directory holding metadata.json and each split's index.json, downloaded first if remote.

    Every rank downloads its own copy under a unique name and renames it into place, so ranks
    sharing a node never read a half-written file.
    """
    if not is_remote(config.remote):
        local_root(config)  # checks that it exists
        return Path(config.remote)
    if not config.remote.startswith("s3://"):
        raise UserError(f"data.remote={config.remote}: only local paths and s3:// are supported")
    from tokstream.object_store import S3Dataset

    store = S3Dataset(config.remote)
    root = Path(local_root(config))
    if not store.exists(METADATA_FILE):
        raise UserError(f"{config.remote} has no {METADATA_FILE}: not a converted dataset, or its conversion "
                        "has not finished")
    for relative in [METADATA_FILE] + [f"{s}/index.json" for s in (config.split, config.val_split)]:
        if relative == METADATA_FILE or store.exists(relative):
            target = root / relative
            temporary = target.with_name(f"{target.name}.{os.getpid()}.tmp")
            store.download(relative, temporary)
            os.replace(temporary, target)
    return root


def dataset_identity(root: Path, split: str) -> str:
    """Digest of the metadata and the split's index: a resumed run must see the very same samples."""
    digest = hashlib.sha256(Path(root, METADATA_FILE).read_bytes())
    digest.update(Path(root, split, "index.json").read_bytes())
    return digest.hexdigest()[:16]


class TokenDataset(StreamingDataset):
    """Stock StreamingDataset with a per-sample path for this format's fixed-size token samples.

    Stock `get_item` opens, seeks and reads the shard file and parses the column encodings for
    every sample. Here each local shard is memory-mapped once (per process) and a sample is a
    slice of it, no copy. Everything else stays streaming's: sample order, partitioning, resume
    state, download-ahead, eviction and hash checks. A shard that is not LOCAL in streaming's
    shared state (not downloaded yet, being downloaded, or evicted) goes through stock `get_item`,
    which fetches it, and is mapped afresh afterwards; a mapping is dropped the moment its shard
    stops being LOCAL, so an evicted file is never read and its disk space is really freed.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._views: dict[int, np.ndarray] = {}  # shard id -> (samples, tokens) view of its mapped file
        self._dtype = None
        self._length = None

    def _map_shard(self, shard_id: int) -> np.ndarray:
        reader = self.shards[shard_id]
        if self._dtype is None:
            encoding = reader.column_encodings[0]  # "ndarray:<dtype>:<length>", see tokstream.format
            _, dtype, length = encoding.split(":")
            self._dtype, self._length = np.dtype(dtype), int(length)
        path = os.path.join(reader.dirname, reader.split, reader.raw_data.basename)
        # A plain ndarray view: slicing a np.memmap subclass costs far more per sample.
        return shard_samples(np.asarray(np.memmap(path, dtype=np.uint8, mode="r")), self._dtype, self._length)

    # streaming runs two background threads per iterator that walk the sample order one sample at
    # a time (download ahead, then mark ready). At tens of thousands of samples per second their
    # Python loops take the GIL from the consumer; these two overrides keep streaming's logic and
    # order but step through a window of samples at once, touching each shard once per window.

    def _window(self, it, start: int) -> tuple[int, np.ndarray]:
        """End of the window of samples from `start` within the predownload bound, and its shards in order."""
        ahead = self.predownload if self.predownload is not None else it.total
        stop = min(it.total, max(start + 1, it.yield_index + ahead + 1))
        ids = it.sample_ids[start:stop]
        shards = np.searchsorted(self.spanner.shard_bounds, ids[ids >= 0], side="right") - 1
        _, first = np.unique(shards, return_index=True)
        return stop, shards[np.sort(first)]

    def _prepare_thread(self, it) -> None:
        while not (it.should_exit() or self._event.is_set()):
            if it.prepare_index == it.total or it.ready_index == it.total:
                it.prepare_index = it.total
                break
            if self.predownload is not None and self.predownload < it.prepare_index - it.yield_index:
                time.sleep(TICK)
                continue
            stop, shards = self._window(it, it.prepare_index)
            for shard_id in shards.tolist():
                self.prepare_shard(shard_id, False)
            it.prepare_index = stop
        it.on_exit()

    def _ready_thread(self, it) -> None:
        while not (it.should_exit() or self._event.is_set()):
            if it.ready_index == it.total:
                break
            if self.predownload is not None and self.predownload < it.ready_index - it.yield_index:
                time.sleep(TICK)
                continue
            stop, shards = self._window(it, it.ready_index)
            for shard_id in shards.tolist():
                if self._shard_states[shard_id] == _REMOTE:
                    self.prepare_shard(shard_id, False)
                while self._shard_states[shard_id] != _LOCAL and not self._event.is_set():
                    time.sleep(TICK)
            it.ready_index = stop
        it.on_exit()

    def get_item(self, sample_id: int) -> dict:
        shard_id, index = self.spanner[sample_id]
        if self._shard_states[shard_id] != _LOCAL:
            self._views.pop(shard_id, None)
            return {"tokens": super().get_item(sample_id)["tokens"], "id": sample_id}  # fetches the shard
        view = self._views.get(shard_id)
        if view is None:
            try:
                view = self._views[shard_id] = self._map_shard(shard_id)
            except FileNotFoundError:  # evicted by another rank between the state check and here
                return {"tokens": super().get_item(sample_id)["tokens"], "id": sample_id}
        if self.cache_limit:
            self._shard_access_times[shard_id] = time.time_ns()  # streaming evicts least recently used
        return {"tokens": view[index], "id": sample_id}


def collate(samples: list[dict]) -> dict[str, torch.Tensor]:
    """Stack into one tensor, still in the dataset's dtype: widened on the device, not here."""
    return {
        "tokens": torch.from_numpy(np.stack([s["tokens"] for s in samples])),
        "ids": torch.tensor([s["id"] for s in samples], dtype=torch.int64),
    }


def _ignore_preemption_signals(worker_id: int) -> None:
    """Workers share the rank's process group, which torchrun signals: only the rank should react
    (it finishes the step and checkpoints); workers end with it."""
    for signum in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, signal.SIG_IGN)


def make_loader(config: DataConfig, split: str, batch_size: int, shuffle: bool, pin_memory: bool,
                num_workers: int | None = None) -> StreamingDataLoader:
    # A remote (or a local dataset with a separate local cache) is downloaded/copied by streaming.
    remote = config.remote if is_remote(config.remote) or config.local else None
    try:
        dataset = TokenDataset(
            remote=remote, local=local_root(config), split=split, shuffle=shuffle,
            shuffle_seed=config.shuffle_seed, shuffle_algo=config.shuffle_algo,
            shuffle_block_size=config.shuffle_block_size, num_canonical_nodes=config.num_canonical_nodes,
            batch_size=batch_size, cache_limit=config.cache_limit, predownload=config.predownload,
            validate_hash=config.validate_hash if remote else None, download_retry=config.download_retry,
        )
    except ValueError as err:  # streaming's word on a bad setting, e.g. a cache_limit below 4 shards
        raise UserError(f"data ({split}): {err}") from None
    workers = config.num_workers if num_workers is None else num_workers
    return StreamingDataLoader(
        dataset, batch_size=batch_size, collate_fn=collate, num_workers=workers, pin_memory=pin_memory,
        drop_last=True, prefetch_factor=config.prefetch_factor if workers else None,
        persistent_workers=False, worker_init_fn=_ignore_preemption_signals,
    )


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
