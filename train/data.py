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
    if is_remote(config.remote):
        if not config.local:
            raise UserError(f"data.remote={config.remote} is remote: set data.local to a local cache directory")
        return config.local
    if not Path(config.remote).is_dir():
        raise UserError(f"data.remote={config.remote} does not exist; convert a dataset first "
                        "(python convert/owt_to_mds.py --out ...)")
    return config.local or config.remote


def fetch_metadata(config: DataConfig) -> DatasetMetadata:
    """The dataset's metadata record, downloaded into the local cache first when remote."""
    root = local_root(config)
    if is_remote(config.remote):
        from streaming.base.storage import download_file

        os.makedirs(root, exist_ok=True)
        download_file(f"{config.remote.rstrip('/')}/{METADATA_FILE}", os.path.join(root, METADATA_FILE), 60)
    return read_metadata(root)


def dataset_identity(config: DataConfig, split: str) -> str:
    """Digest of the metadata and the split's index: a resumed run must see the very same samples."""
    root = local_root(config)
    digest = hashlib.sha256(Path(root, METADATA_FILE).read_bytes())
    index = Path(root, split, "index.json")
    if index.is_file():  # remote splits are indexed by StreamingDataset on first use
        digest.update(index.read_bytes())
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
    remote = config.remote if is_remote(config.remote) else None
    dataset = TokenDataset(
        remote=remote, local=local_root(config), split=split, shuffle=shuffle,
        shuffle_seed=config.shuffle_seed, shuffle_algo=config.shuffle_algo,
        shuffle_block_size=config.shuffle_block_size, num_canonical_nodes=config.num_canonical_nodes,
        batch_size=batch_size, cache_limit=config.cache_limit,
    )
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
