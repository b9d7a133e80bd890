"""Training data: the converters' MDS datasets through StreamingDataset and StreamingDataLoader.

Partitioning over ranks and workers, shuffling, download-ahead and resumption are streaming's;
this module only chooses the arguments, adds the global sample id to each sample (for tracing
and tests), and collates uint16 tokens without widening them on the host.
"""

import hashlib
import os
import signal
from pathlib import Path

import numpy as np
import torch
from streaming import StreamingDataLoader, StreamingDataset

from config import DataConfig
from tokstream.errors import UserError
from tokstream.format import METADATA_FILE, DatasetMetadata, read_metadata


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


def fetch_metadata(config: DataConfig) -> DatasetMetadata:
    return read_metadata(fetch_index_files(config))


def dataset_identity(config: DataConfig, split: str) -> str:
    """Digest of the metadata and the split's index: a resumed run must see the very same samples."""
    root = fetch_index_files(config)
    digest = hashlib.sha256(Path(root, METADATA_FILE).read_bytes())
    digest.update(Path(root, split, "index.json").read_bytes())
    return digest.hexdigest()[:16]


class TokenDataset(StreamingDataset):
    """Stock StreamingDataset whose samples also carry their global sample id."""

    def get_item(self, sample_id: int) -> dict:
        return {"tokens": super().get_item(sample_id)["tokens"], "id": sample_id}


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
            batch_size=batch_size, cache_limit=config.cache_limit,
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


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets on the device as int64, from the B + 1 token samples."""
    tokens = batch["tokens"].to(device, non_blocking=True).long()
    return tokens[:, :-1], tokens[:, 1:]
