"""The project's fast reader (tokstream/train/token_dataset.py) against stock StreamingDataset.

Same samples, same order, for several seeds, worker counts and resume points; under a small
cache_limit with a remote dataset (shards evicted and fetched again) the samples stay exact.
"""

import gc
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import shakespeare_paragraphs

from tokstream.cleaning import Cleaning
from tokstream.options import ConversionOptions
from tokstream.text_conversion import convert_text
from tokstream.train.config import DataConfig
from tokstream.train.data import collate, make_loader, to_device

BATCH = 8


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, gpt2):
    tmp = tmp_path_factory.mktemp("fast")
    corpus = tmp / "plays.txt"
    corpus.write_text("\n\n".join(shakespeare_paragraphs()) + "\n")
    convert_text([str(corpus)], str(tmp / "ds"), {"txt_docs": "paragraph"}, Cleaning(),
                 ConversionOptions(block_size=64, val_fraction=0, shard_size="64kb", progress=False), gpt2)
    return tmp / "ds"


def fresh_copy(dataset, tmp_path, name):
    """Each StreamingDataset gets its own directory: streaming refuses two live ones on one."""
    target = tmp_path / name
    shutil.copytree(dataset, target)
    return target


def stock_batches(root, seed: int, workers: int, state: dict | None = None, limit: int | None = None,
                  shuffle_block_size: int | None = None):
    from streaming import StreamingDataLoader, StreamingDataset

    ds = StreamingDataset(local=str(root), split="train", shuffle=True, shuffle_seed=seed, num_canonical_nodes=1,
                          batch_size=BATCH, shuffle_block_size=shuffle_block_size)
    loader = StreamingDataLoader(ds, batch_size=BATCH, num_workers=workers, drop_last=True)
    if state:
        loader.load_state_dict(state)
    out = []
    for batch in loader:
        out.append(batch["tokens"].numpy().copy())
        if limit and len(out) == limit:
            break
    del loader, ds
    gc.collect()
    return out


def project_loader(root, seed: int, workers: int, **data):
    config = DataConfig(remote=str(root), shuffle_seed=seed, num_workers=workers, **data)
    return make_loader(config, "train", BATCH, shuffle=True, pin_memory=False)


@pytest.mark.parametrize("seed, workers", [(1, 0), (9176, 2), (424242, 0), (424242, 2)])
def test_same_samples_same_order_as_stock(dataset, tmp_path, seed, workers):
    expected = stock_batches(fresh_copy(dataset, tmp_path, "stock"), seed, workers)
    loader = project_loader(fresh_copy(dataset, tmp_path, "ours"), seed, workers)
    got = [batch["tokens"].numpy().copy() for batch in loader]
    assert loader.dataset.num_samples > 4000 and len(got) == len(expected)
    assert got[0].dtype == np.uint16  # stays narrow until the device
    np.testing.assert_array_equal(np.concatenate(got), np.concatenate(expected))


@pytest.mark.parametrize("resume_after", [1, 57, 300])
def test_resume_points_continue_like_stock(dataset, tmp_path, resume_after):
    loader = project_loader(fresh_copy(dataset, tmp_path, "ours"), 7, 0)
    iterator = iter(loader)
    for _ in range(resume_after):
        next(iterator)
    state = loader.state_dict()
    del iterator, loader
    gc.collect()

    resumed = project_loader(fresh_copy(dataset, tmp_path, "ours2"), 7, 0)
    resumed.load_state_dict(state)
    got = [batch["tokens"].numpy().copy() for batch in resumed]
    del resumed
    gc.collect()
    expected = stock_batches(fresh_copy(dataset, tmp_path, "stock"), 7, 0, state=state)
    assert len(got) == len(expected) > 0
    np.testing.assert_array_equal(np.concatenate(got), np.concatenate(expected))


def mapped_deleted_files(directory: Path) -> set[str]:
    """Files under `directory` that this process still maps although they were deleted."""
    maps = Path("/proc/self/maps").read_text().splitlines()
    return {line.split(maxsplit=5)[5] for line in maps if str(directory) in line and line.endswith("(deleted)")}


def test_eviction_under_a_small_cache_limit_keeps_samples_exact(dataset, tmp_path):
    """From S3 on loopback with a cache far smaller than the 11 shards: shards are evicted and fetched again."""
    from tokstream.object_store import S3Dataset
    from tokstream.testing.loopback_s3 import start_loopback_s3

    saved = dict(os.environ)
    server = start_loopback_s3("evict")
    try:
        store = S3Dataset("s3://evict/ds")
        for path in sorted(dataset.rglob("*")):
            if path.is_file():
                store.upload(path, path.relative_to(dataset).as_posix())
        shards = len(list((dataset / "train").glob("shard.*")))
        # Shuffle blocks of ~2 shards: the cache cycles through the dataset instead of thrashing.
        expected = np.concatenate(stock_batches(fresh_copy(dataset, tmp_path, "stock"), 3, 0,
                                                shuffle_block_size=1000))

        cache = tmp_path / "cache"
        config = DataConfig(remote="s3://evict/ds", local=str(cache), shuffle_seed=3, num_workers=0,
                            cache_limit="300kb", predownload=64, shuffle_block_size=1000)
        loader = make_loader(config, "train", BATCH, shuffle=True, pin_memory=False)
        got, most_local, most_deleted_mapped = [], 0, 0
        for batch in loader:
            got.append(batch["tokens"].numpy().copy())
            most_local = max(most_local, len(list((cache / "train").glob("shard.*.mds"))))
            most_deleted_mapped = max(most_deleted_mapped, len(mapped_deleted_files(cache)))
        np.testing.assert_array_equal(np.concatenate(got), expected)
        assert shards > 8 and most_local < shards  # shards were evicted (and some fetched again)
        # An evicted shard's disk space is really freed: its mapping goes when the reader maps its next
        # shard, so at most what the download-ahead window evicts meanwhile stays mapped (2 seen), not
        # every evicted shard until it is read again (7 of the 11 before).
        assert most_deleted_mapped <= 3, most_deleted_mapped
        del loader
        gc.collect()
    finally:
        server.stop()
        os.environ.clear()
        os.environ.update(saved)
    assert torch is not None


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_tokens_reach_the_model_as_exact_int64_inputs_and_targets(dtype):
    """The highest token ids survive the trip: no sign flip from the narrow unsigned dtype."""
    top = np.iinfo(dtype).max
    rows = [np.array([0, 1, 32767, 32768, 50256, top], dtype=dtype),
            np.array([top, top - 1, 65535, 65536 % (top + 1), 7, 100000 % (top + 1)], dtype=dtype)]
    batch = collate([{"tokens": row, "id": i} for i, row in enumerate(rows)])
    inputs, targets = to_device(batch, torch.device("cpu"))
    expected = torch.from_numpy(np.stack(rows).astype(np.int64))
    assert inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(inputs, expected[:, :-1]) and torch.equal(targets, expected[:, 1:])


def test_the_vectorized_sampling_draws_what_streamings_loop_draws():
    """How many samples an epoch draws from each shard when it takes a fraction of a stream (every epoch cut
    to whole steps does): the fence's replacement for streaming's get_sampling, in force in every dataset,
    against streaming's own function."""
    from tokstream.train.streaming_internals import (get_sampling_vectorized, stock_get_sampling,
                                                     vectorized_sampling_in_force)

    assert vectorized_sampling_in_force()
    rng = np.random.default_rng(0)
    for _ in range(400):
        shards = rng.integers(1, 60, rng.integers(1, 12)).astype(np.int64)
        args = (shards, int(rng.integers(0, 4 * shards.sum())), int(rng.choice([1, 1, 1, 2, 3, 7, 100])),
                int(rng.integers(0, 1000)), int(rng.integers(0, 5)), bool(rng.integers(0, 2)))
        np.testing.assert_array_equal(get_sampling_vectorized(*args), stock_get_sampling(*args), err_msg=str(args))
    with pytest.raises(ValueError, match="must be a non-negative integer"):
        get_sampling_vectorized(shards, -1, 1, 0, 0, True)
