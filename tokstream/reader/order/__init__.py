"""The order a dataset is read in: which sample each rank and worker reads at each step of each epoch.

- keyed.py, hypergeometric.py: keyed randomness the same in every process and numpy release;
- lazy.py: the lazy order (data.shuffle_algo: lazy), computed where it is read;
- feistel_window.py: the first lazy order, kept for the runs read in it;
- partition.py: streaming's partition over nodes, ranks and workers, in closed form;
- read_check.py: a step's samples as two sums, recorded by the run and checked by the ledger;
- sampling.py, py1e.py: streaming's resampling and py1e shuffle, the same numbers, vectorized (the door puts them
  where streaming calls its own, and composes them with streaming's partition: streaming_door/epoch_order.py);
- stock_sequence.py: the two composed, the epoch's sequence before the partition (the door hands it streaming's
  registry of shuffles; order files in py1e, the default, need nothing of streaming);
- order_files.py: streaming's own orders (py1e) kept as checksummed files, built once per epoch and mapped by every
  rank; the door hands it how to compute them (its OrderInputs.compute: the door's epoch_order, stock's numbers).

None of it imports streaming: the door (streaming_door/) registers these orders in streaming and hands them what
they read (the shards' sizes, the streams' draws, the settings).
"""

import numpy as np

from tokstream.reader.order import feistel_window, lazy

# The project's own orders, computed where they are read, by data.shuffle_algo.
LAZY_ORDERS = {lazy.NAME: lazy.EpochOrder, feistel_window.NAME: feistel_window.FeistelWindowOrder}


def lazy_epoch_order(algo: str, samples_per_shard: np.ndarray, shards_per_stream: list[int],
                     chooses: list[int | None], seed: int, epoch: int, num_canonical_nodes: int, block_size: int):
    """The epoch's order in the lazy order named `algo`: `.at(positions)`, `.epoch_size`."""
    return LAZY_ORDERS[algo](samples_per_shard, shards_per_stream, chooses, seed, epoch, num_canonical_nodes,
                             block_size)


def whole_epoch(algo: str):
    """streaming's shuffle interface (shuffle.algos) for a lazy order: the whole epoch's order, as stock reads it (its
    resampled shards taken as they are)."""

    def get_shuffle(shard_sizes: np.ndarray, num_canonical_nodes: int, seed: int, epoch: int,
                    block_size: int = 1 << 18) -> np.ndarray:
        sizes = np.asarray(shard_sizes, np.int64)
        order = lazy_epoch_order(algo, sizes, [len(sizes)], [None], seed, epoch, num_canonical_nodes, block_size)
        return order.at(np.arange(order.epoch_size, dtype=np.int64))

    return get_shuffle
