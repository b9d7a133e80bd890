"""streaming's epoch sequence before the partition deals it out (position -> sample id): its resampling of the streams,
then its shuffle of the resampled shards, composed in place.

The door's epoch_order passes the shuffle of streaming's registry (any of its algorithms); order files in py1e are
computed with the order's own py1e, the function install() puts in that registry, so that order files' builder, a
process of its own at every epoch, imports neither streaming nor torch.
"""

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tokstream.reader.order.py1e import get_shuffle_py1e_fast, look_up_in_place
from tokstream.reader.order.sampling import resampled_sample_ids, resampled_shards

# streaming's shuffle interface: (shard sizes, canonical nodes, seed, epoch, block size) -> the shuffled positions.
Shuffle = Callable[[np.ndarray, int, int, int, int], np.ndarray]


def stock_sequence(dataset, epoch: int, shuffle: Shuffle | None) -> np.ndarray:
    """The epoch's sequence by stock's resampling (`dataset`: streaming's attribute names) and `shuffle`, None when
    the dataset does not shuffle. The resampling's draws run in a thread beside the shuffle (numpy lets go of the GIL
    in both)."""
    units, shards = resampled_shards(dataset, epoch)
    with ThreadPoolExecutor(1) as pool:
        mapping = pool.submit(resampled_sample_ids, dataset, epoch, shards)
        shuffled = shuffled_units(dataset, units, epoch, shuffle)
        order = mapping.result()  # resampled ("big") id -> sample id
        del mapping  # it would hold the mapping alive through the partition, after it is composed
    return order if shuffled is None else look_up_in_place(shuffled, order)


def shuffled_units(dataset, units: np.ndarray, epoch: int, shuffle: Shuffle | None) -> np.ndarray | None:
    if not dataset.shuffle:
        return None
    if not isinstance(dataset.shuffle_block_size, int):  # stock's check, after its resampling as in stock
        raise TypeError(f"Dataset `shuffle_block_size` must be an integer. Got {type(dataset.shuffle_block_size)} "
                        "instead.")
    return shuffle(units, dataset.num_canonical_nodes, dataset.shuffle_seed, epoch, dataset.shuffle_block_size)


def py1e_sequence(dataset, epoch: int) -> np.ndarray:
    """stock_sequence in py1e (or unshuffled), with nothing of streaming."""
    if dataset.shuffle and dataset.shuffle_algo != "py1e":
        raise ValueError(f"py1e_sequence computes py1e alone, not {dataset.shuffle_algo}")
    return stock_sequence(dataset, epoch, get_shuffle_py1e_fast)
