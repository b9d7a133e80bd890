"""Which samples each rank reads in each step, without reading any: TrainBatches' order, computed from the
dataset's index and settings alone (streaming's partition of each epoch, through the door). The ledger
(train/ledger.py) answers "which samples were in step N" with it, for steps a run made and steps it has not.

Why a step's samples do not depend on where the reader started: streaming deals an epoch's order out to the
ranks sample by sample, node after node, then rank after rank within a node (its partition), and a reader
resumed at sample s deals out the order from s alike. A global batch is a multiple of the ranks, so each rank's
part of step k is the same slice of its rows whether the reader started at step 0 or at step k. DataLoader
workers take a rank's rows in batches dealt out in turn, and the loader takes them back in turn.
"""

import numpy as np

from tokstream.errors import UserError
from tokstream.reader.batch_plan import BatchPlan
from tokstream.reader.batches import _source_of, make_loader
from tokstream.reader.dataset import Dataset
from tokstream.reader.streaming_door import streaming_internals as internals


class SampleOrder:
    """The order of TrainBatches(dataset, BatchPlan(global_batch_size, m, ranks)) for any micro-batch m, number
    of DataLoader workers and interruptions. Opens the dataset's train split as a reader does (one process);
    close() when done."""

    def __init__(self, dataset: Dataset, global_batch_size: int):
        self.global_batch_size = global_batch_size
        self.epoch_samples = dataset.epoch_samples(BatchPlan(global_batch_size, 1, 1))  # per source, whole steps
        self.epoch_size = sum(self.epoch_samples)
        # Batch 1: the batch size only places the padding at an epoch's end, past its whole steps.
        self._loader = make_loader(dataset.config, dataset.config.split, 1, shuffle=True, pin_memory=False,
                                   num_workers=0, choose=self.epoch_samples, sources=dataset.sources,
                                   vocab_sizes=[m.vocab_size for m in dataset.metadata])
        self.first_sample_of_source = np.asarray(self._loader.dataset.sample_offset_per_stream)
        self._rows: tuple | None = None  # the last epoch's rows computed: (nodes, ranks_per_node, epoch, start, rows)

    def steps(self, first: int, count: int, nodes: int = 1, ranks_per_node: int = 1) -> np.ndarray:
        """(count, ranks, global_batch_size // ranks) sample ids: what each rank of `nodes` x `ranks_per_node` reads
        in steps first .. first + count - 1 (0-based), in the order it reads them; a step may not span an epoch."""
        ranks = nodes * ranks_per_node
        if nodes < 1 or ranks_per_node < 1 or self.global_batch_size % ranks:
            raise UserError(f"a global batch of {self.global_batch_size} samples does not divide over {nodes} nodes "
                            f"x {ranks_per_node} ranks")
        if first < 0 or count < 0:
            raise ValueError(f"steps from {first}, {count} of them: both count from 0")
        per_rank = self.global_batch_size // ranks
        read = np.empty((count, ranks, per_rank), np.int64)
        done = 0
        while done < count:
            epoch, start = divmod((first + done) * self.global_batch_size, self.epoch_size)
            take = min(count - done, (self.epoch_size - start) // self.global_batch_size)
            rows = self._rows_from(nodes, ranks_per_node, epoch, start, take)[:, :take * per_rank]
            read[done:done + take] = rows.reshape(ranks, take, per_rank).transpose(1, 0, 2)
            done += take
        return read

    def _rows_from(self, nodes: int, ranks_per_node: int, epoch: int, start: int, steps: int) -> np.ndarray:
        """Each rank's rows from sample `start` of `epoch`, at least `steps` steps of them: a slice of the last ones
        computed when they cover it (in streaming's orders computing them costs a pass over the epoch; in the lazy
        order each is computed alone)."""
        ranks = nodes * ranks_per_node
        if internals.in_lazy_order(self._loader.dataset):  # each step computed alone, in O(its samples)
            return internals.rank_orders(self._loader.dataset, nodes, ranks_per_node, epoch, start,
                                         limit=self.global_batch_size // ranks * steps)
        if self._rows is not None:
            *layout, rows = self._rows
            if layout[:3] == [nodes, ranks_per_node, epoch] and start >= layout[3]:
                return rows[:, (start - layout[3]) // ranks:]
        rows = internals.rank_orders(self._loader.dataset, nodes, ranks_per_node, epoch, start)
        self._rows = (nodes, ranks_per_node, epoch, start, rows)
        return rows

    def build_order_files(self, epochs: range) -> list[str]:
        """Build the epochs' orders as files in data.order_dir now (order/order_files.py), which readers
        then map instead of building: the paths, [] where the data is read in the lazy order or has no order_dir."""
        return [str(path) for path in internals.build_order_files(self._loader.dataset, epochs)]

    def source_of(self, sample_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each sample's source (index in the dataset's sources) and its id within that source."""
        sample_ids = np.asarray(sample_ids, dtype=np.int64)
        sources = _source_of(self.first_sample_of_source, sample_ids)  # as TrainBatches labels them
        return sources, sample_ids - self.first_sample_of_source[sources]

    def tokens(self, sample_ids: list[int]) -> np.ndarray:
        """The samples' block_size + 1 token ids, read as the reader reads them (fetched first when remote)."""
        return self._loader.dataset.get_batch([int(i) for i in sample_ids])["tokens"].numpy()

    def close(self) -> None:
        self._loader.dataset.release_shared_memory()
