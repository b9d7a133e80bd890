"""The one place that touches mosaicml-streaming's private internals; nothing else in the project does.

Checked against mosaicml-streaming 0.13.0 (CHECKED_VERSIONS). Importing this module with any
other version fails with one line, because what follows relies on names streaming does not
promise to keep:

- `_ShardState` and `StreamingDataset._shard_states`: whether a shard is on local disk;
- `StreamingDataset._shard_access_times`: the clock streaming's cache eviction reads;
- `StreamingDataset._prepare_thread` / `_ready_thread` and the iterator fields they move
  (`prepare_index`, `ready_index`, `yield_index`, `total`, `sample_ids`): download-ahead;
- `StreamingDataset._event`: set when the dataset is shutting down;
- `streaming.base.shared.prefix._unpack_locals` / `_pack_locals` and `_shm_prefix_int`: which
  cache directories a shared-memory prefix belongs to;
- `streaming.base.dataset.get_sampling`, the name `resample_streams` calls: replaced by
  `get_sampling_vectorized`, the same result without a Python loop per sample (see there).

To move to a new streaming version: read those names in its source, run the fast-reader and
training tests (tests/test_fast_reader.py, tests/test_training.py), then add the version here.
"""

import os
import time

import numpy as np
import streaming
import streaming.base.dataset as streaming_dataset_module
from streaming import StreamingDataset
from streaming.base.constant import BARRIER_FILELOCK, CACHE_FILELOCK, LOCALS, SHM_TO_CLEAN, TICK
from streaming.base.dataset import _ShardState
from streaming.base.sampling import get_sampling as stock_get_sampling
from streaming.base.shared.prefix import _pack_locals, _unpack_locals

from tokstream.errors import UserError

CHECKED_VERSIONS = ("0.13.0",)
if streaming.__version__ not in CHECKED_VERSIONS:
    raise UserError(f"mosaicml-streaming {streaming.__version__} is installed; this project reaches into its "
                    f"internals and is checked only against {', '.join(CHECKED_VERSIONS)}: "
                    f"pip install mosaicml-streaming=={CHECKED_VERSIONS[-1]}")

_LOCAL = int(_ShardState.LOCAL)  # plain ints: IntEnum comparisons are slow per sample
_REMOTE = int(_ShardState.REMOTE)

# Names of the shared-memory blocks and /tmp lock files streaming creates per dataset prefix.
SHM_BLOCK_SUFFIXES = tuple(SHM_TO_CLEAN)
LOCALS_BLOCK = LOCALS
LOCK_FILE_SUFFIXES = (BARRIER_FILELOCK, CACHE_FILELOCK)


def get_sampling_vectorized(samples_per_shard: np.ndarray, choose: int, granularity: int, seed: int, epoch: int,
                            use_epoch: bool) -> np.ndarray:
    """streaming's `get_sampling`, the same numbers, without its Python loop over every sample.

    When a stream's epoch draws a fraction of its samples (every epoch cut to whole steps does),
    streaming shuffles the stream's "picks" (one per sample at granularity 1) and adds them up in a
    Python loop until the epoch is full: 12-21 s at OpenWebText's 8.8 M samples on this machine, in
    the node's first rank at every epoch start and every resume, before the first batch
    (bench/scale.py). At streaming's default granularity of one sample per pick, the loop takes the
    first `remainder` shuffled picks, which is a slice and a count per shard. Equal to streaming's
    on random inputs (tests/test_fast_reader.py).
    """
    num_samples = int(np.sum(samples_per_shard))
    if granularity != 1 or choose < 0 or seed < 0 or epoch < 0 or not choose % num_samples:
        # Its checks, its whole-repeat case, and a sampling_granularity this project never sets.
        return stock_get_sampling(samples_per_shard, choose, granularity, seed, epoch, use_epoch)
    # A pick per sample, shuffled with streaming's generator: the first `remainder` picks count, 1 each.
    remainder = choose % num_samples
    ordering = np.random.default_rng(seed + epoch if use_epoch else seed).permutation(num_samples)
    ends = np.cumsum(samples_per_shard)
    whole = samples_per_shard * (choose // num_samples)
    if remainder <= num_samples // 2:
        return whole + np.bincount(np.searchsorted(ends, ordering[:remainder], side="right"),
                                   minlength=len(samples_per_shard))
    # An epoch cut to whole steps leaves out a few picks: count those (0.5 s less at 8.8 M samples).
    left_out = np.bincount(np.searchsorted(ends, ordering[remainder:], side="right"), minlength=len(samples_per_shard))
    return whole + samples_per_shard - left_out


streaming_dataset_module.get_sampling = get_sampling_vectorized


def vectorized_sampling_in_force() -> bool:
    """Whether StreamingDataset.resample_streams calls get_sampling_vectorized."""
    return streaming_dataset_module.get_sampling is get_sampling_vectorized


def shard_is_local(dataset: StreamingDataset, shard_id: int) -> bool:
    """Whether streaming's shared state says the shard is downloaded (and not being evicted)."""
    return dataset._shard_states[shard_id] == _LOCAL


def mark_shard_used(dataset: StreamingDataset, shard_id: int) -> None:
    """Tell streaming's least-recently-used eviction that the shard was just read."""
    if dataset.cache_limit:
        dataset._shard_access_times[shard_id] = time.time_ns()


def shard_file(dataset: StreamingDataset, shard_id: int) -> str:
    """Path of the shard's uncompressed file in the local cache."""
    reader = dataset.shards[shard_id]
    return os.path.join(reader.dirname, reader.split, reader.raw_data.basename)


def first_column_encoding(dataset: StreamingDataset) -> str:
    """The MDS encoding string of the dataset's first column (tokstream.format parses it)."""
    return dataset.shards[0].column_encodings[0]


def locals_of_block(data: bytes) -> list[str]:
    """The cache directories a `NNNNNN_locals` shared-memory block registers."""
    directories, _ = _unpack_locals(data)
    return directories


def locals_block(directories: list[str], prefix: int) -> bytes:
    """The bytes streaming writes to a `locals` block (tests plant stale blocks with it)."""
    return _pack_locals(directories, prefix)


def shm_prefix(dataset: StreamingDataset) -> int:
    """The number of the shared-memory prefix a live dataset registered."""
    return dataset._shm_prefix_int


class WindowedDownloadAhead(StreamingDataset):
    """StreamingDataset whose download-ahead threads step through the sample order a window at a time.

    streaming runs two background threads per iterator that walk the sample order one sample at a
    time (prepare: start downloads; ready: wait until each shard is local). At tens of thousands of
    samples per second their Python loops take the GIL from the consumer. These overrides keep
    streaming's logic, bounds and order but handle a window of samples at once, touching each
    shard once per window.
    """

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
            if all(self._wait_until_local(it, shard_id) for shard_id in shards.tolist()):
                it.ready_index = stop
        it.on_exit()

    def _wait_until_local(self, it, shard_id: int) -> bool:
        """Fetch the shard if it is remote and wait until it is local; False if the iterator is done first.

        Unlike streaming's own wait, this one re-fetches a shard evicted (back to REMOTE) while it
        waited, and gives up when the iterator exits (a new epoch, or process exit). Without both,
        a thread waiting on an evicted shard never ends and the process hangs at exit (seen on a
        loaded node with a small cache_limit).
        """
        while self._shard_states[shard_id] != _LOCAL:
            if it.should_exit() or self._event.is_set():
                return False
            if self._shard_states[shard_id] == _REMOTE:
                self.prepare_shard(shard_id, False)
            else:
                time.sleep(TICK)  # another thread or rank is downloading it
        return True
