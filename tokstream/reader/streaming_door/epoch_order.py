"""Streaming's epoch order (its `random` batching over the py1e shuffle), put together from the order's parts.

At every epoch start and every resume the first rank of each node computes the epoch's sample order before any rank
gets a batch: at OpenWebText's 8.8 M samples stock took seconds (bench/scale.py). install() puts the order's equal,
faster parts (tokstream/reader/order/: `sampling.get_sampling_vectorized`, `py1e.get_shuffle_py1e_fast`) where
streaming calls its own, and this module's `generate_work_random` in place of streaming's `random` batching: the same
array, composed in place, each epoch-sized array dropped once used. It is the door's because it calls streaming's
own partition and its registry of shuffles; tested equal to stock (tests/test_epoch_order.py).
"""

import numpy as np

from tokstream.reader.order.py1e import look_up_in_place
from tokstream.reader.order.stock_sequence import shuffled_units, stock_sequence
from tokstream.reader.streaming_door import streaming_internals as internals
from tokstream.reader.streaming_door.streaming_internals import get_partitions, get_shuffle


def generate_work_random(dataset, world, epoch: int, sample_in_epoch: int) -> np.ndarray:
    """streaming's `generate_work_random_batching`, the same array, with fewer epoch-sized arrays alive.

    Stock resamples the streams, makes the partition of the epoch over nodes, ranks, workers and
    batches, shuffles, and composes the three by two `np.where` copies, all alive at once. Here the
    resampling's draws run in a thread beside the shuffle's (numpy lets go of the GIL in both), its
    mapping is composed into the shuffle and the shuffle into the partition, in place, and each array
    is dropped once used. Only the local leader of each node runs this (in `_get_work`).
    """
    if dataset.num_canonical_nodes is None:
        raise RuntimeError("`num_canonical_nodes` can never be None. Provide a positive integer.")
    if not isinstance(dataset.batch_size, int):
        raise TypeError(f"Batch size must be an integer. Got {type(dataset.batch_size)}.")
    order = epoch_sequence(dataset, epoch)
    ids = get_partitions(dataset.partition_algo, dataset.epoch_size, dataset.num_canonical_nodes, world.num_nodes,
                         world.ranks_per_node, world.workers_per_rank, dataset.batch_size, sample_in_epoch,
                         dataset.initial_physical_nodes)
    return look_up_in_place(ids, order)


def epoch_sequence(dataset, epoch: int) -> np.ndarray:
    """The epoch's samples in streaming's order, before the partition deals them out: position -> sample id
    (the array `generate_work_random` indexes with the partition; order_files.py keeps it as a file)."""
    def shuffle(units, num_canonical_nodes, seed, of_epoch, block_size):  # streaming's registry, as stock calls it
        return get_shuffle(dataset.shuffle_algo, units, num_canonical_nodes, seed, of_epoch, block_size)

    stock = internals.StreamingDataset.resample_streams
    if getattr(type(dataset), "resample_streams", stock) is stock:  # order files' inputs: stock's, by definition
        return stock_sequence(dataset, epoch, shuffle)
    units, order = dataset.resample_streams(epoch)  # a subclass's own resampling
    shuffled = shuffled_units(dataset, units, epoch, shuffle)
    return order if shuffled is None else look_up_in_place(shuffled, order)
