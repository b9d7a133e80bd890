"""The fence of the door (streaming_door/): the private names of streaming the project relies on.

Checked against mosaicml-streaming 0.13.0 and streaming-community 0.14 (CHECKED_VERSIONS). Importing
this module with any other version fails with one line, because what follows relies on names
streaming does not promise to keep:

- `_ShardState` and `StreamingDataset._shard_states`: whether a shard is on local disk;
- `StreamingDataset._shard_access_times`: the clock streaming's cache eviction reads;
- `StreamingDataset._prepare_thread` / `_ready_thread` and the iterator fields they move
  (`prepare_index`, `ready_index`, `yield_index`, `total`, `sample_ids`): download-ahead;
- `StreamingDataset._each_sample_id`, the yield loop `__iter__` maps `__getitem__` over: it hands
  over a batch's ids at once here;
- `StreamingDataset._event`: set when the dataset is shutting down (or a thread failed);
- `StreamingDataset.prepare_shard`'s states (REMOTE -> PREPARING -> LOCAL), `_cache_filelock`,
  `cache_usage`, `_evict_coldest_shard`, the shard readers' `file_pairs` and stock downloaders'
  `<file>.tmp`: a failed download is undone, and a full disk evicts;
- `streaming.base.shared.prefix._unpack_locals` / `_pack_locals` and `_shm_prefix_int`: which
  cache directories a shared-memory prefix belongs to;
- `streaming.base.dataset.get_sampling`, the name `resample_streams` calls,
  `streaming.base.shuffle.algos["py1e"]` and `streaming.base.batching.batching_methods["random"]`:
  replaced (`install_epoch_order`) by equal versions: the order's `sampling.get_sampling_vectorized` and
  `py1e.get_shuffle_py1e_fast` (tokstream/reader/order/), and epoch_order.py's batching, which composes them
  with streaming's own `get_shuffle` and `get_partitions`;
- `StreamingDataset._share_work`: the epoch's order goes into shared memory without a copy first;
- `streaming.base.dataset.SharedBarrier`, the class a dataset makes its node barrier from, and its protocol on
  its shared fields (`num_enter`, `num_exit`, `flag`, `lock`): NodeBarrier in its place (`install_node_barrier`),
  the same protocol, whose waits end when a process of the node that read the dataset has ended;
- `streaming.base.dataset.FileLock` and `streaming.base.shared.barrier.FileLock`, the names a dataset
  creates its barrier's and cache's file locks from (`_shared_barrier.lock`, `_cache_filelock`; the
  barrier's own in streaming-community 0.14): PromptFileLock in their place (`install_file_lock`);
- `streaming.base.stream.reader_from_json`, which Stream.get_shards builds each shard's reader with:
  replaced (`install_reader_from_json`) by lean_readers.py's, the same readers without deepcopy;
- `streaming.base.dataset.Spanner`, the class a dataset builds its sample-to-shard lookup from:
  replaced (`install_spanner`) by lean_spanner.py's subclass, the same fields built without an
  array of every sample;
- `streaming.base.dataset.get_shm_prefix`, which numbers a dataset's shared-memory blocks:
  replaced (`install_prefix_registration`) by prefix_registration.py's, which repeats stock's scan
  (`first_free_prefix`: `_check_self`, then /dev/shm read by name) on its block layout (`_get_path`,
  `_pack_locals`);
- `streaming.base.shared.memory.BuiltinSharedMemory`, the class streaming's SharedMemory creates or attaches
  blocks with: SizedBlock in its place (`install_sized_attach`), which waits for a block its creator has not
  sized yet;
- the SharedMemory blocks a dataset holds, which stock keeps until exit through atexit: released when
  the dataset closes or goes (`shared_memory_blocks`, `release_shared_memory`);
- `StreamingDataset._resume` and what it sets from a resume state: answered from the loading process's
  own copy (`ResumeStateKept`);
- `StreamingDataset._resume_incr_epoch`, where the node's first process sets `next_epoch` after the barrier
  (`_shared_barrier`, `_unique_worker_world.workers_per_node`): a second wait there (`ResumeStateKept`);
- `generate_work` with `StreamingDataset.batching_method` and `_set_shuffle_block_size`: the epoch's
  partition for any world, computed in one process (`rank_orders`, for train/ledger.py);
- `StreamingDataset._get_work`, `_parallel_worker_world` and `_unique_worker_world`: a dataset in the project's lazy
  shuffle, or whose orders are kept as files (order_files.py), gets its worker's ids computed as they are read
  (`WindowedDownloadAhead._get_work`, order/lazy.py); the node's first worker starts the next epoch's file.

To move to a new streaming version: read those names in its source, run the fast-reader and
training tests (tests/test_fast_reader.py, tests/test_training.py), then add the version here.
"""

import atexit
import importlib.metadata
import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from tempfile import gettempdir

import numpy as np
from filelock import FileLock, Timeout

from tokstream.reader.streaming_door.streaming_import import import_streaming

import_streaming()  # before streaming is imported: without transformers and torchvision (streaming_import.py)
import streaming
import streaming.base.batching as streaming_batching_module
from streaming.base.batching import generate_work
import streaming.base.dataset as streaming_dataset_module
import streaming.base.shared.barrier as streaming_barrier_module
import streaming.base.shared.memory as streaming_memory_module
import streaming.base.shuffle as streaming_shuffle_module
import streaming.base.stream as streaming_stream_module
from streaming import StreamingDataset
from streaming.base.constant import BARRIER_FILELOCK, CACHE_FILELOCK, EPOCH_DATA, EPOCH_SHAPE, LOCALS, SHM_TO_CLEAN, TICK
from streaming.base.batching.random import generate_work_random_batching  # noqa: F401  (tests)
from streaming.base.dataset import _ShardState
from streaming.base.partition import get_partitions  # noqa: F401  (epoch_order.py)
from streaming.base.sampling import get_sampling as stock_get_sampling  # noqa: F401  (tests, bench)
from streaming.base.shared import SharedMemory
from streaming.base.shared.prefix import _check_self, _get_path, _pack_locals, _unpack_locals
from streaming.base.shared.prefix import get_shm_prefix as stock_get_shm_prefix  # noqa: F401  (prefix_registration.py)
from streaming.base.shuffle import get_shuffle  # noqa: F401  (epoch_order.py, tests)
from streaming.base.shuffle.py1e import get_shuffle_py1e as stock_get_shuffle_py1e  # noqa: F401  (tests)
from streaming.base.shuffle.py1s import divide_spans  # noqa: F401  (tests)
from streaming.base.spanner import Spanner  # noqa: F401  (lean_spanner.py)
from streaming.base.format import FileInfo  # noqa: F401  (lean_readers.py)
from streaming.base.format import reader_from_json as stock_reader_from_json  # noqa: F401  (lean_readers.py)
from streaming.base.format.mds.reader import MDSReader  # noqa: F401  (lean_readers.py)
from streaming.base.world import World
from torch.utils.data import get_worker_info

from tokstream.errors import NoSpace, PeerEnded, UserError, no_space, out_of_space
from tokstream.format import index_shards

# The distributions that provide the `streaming` module, and the versions of each these names were read in.
# streaming-community is mosaicml-streaming's maintained fork (same module, MDS format and state keys);
# the suite runs against 0.14.2 (requirements-community.lock), and its 0.14 releases keep these names.
CHECKED_VERSIONS = {"mosaicml-streaming": ("0.13.0",), "streaming-community": ("0.14.",)}


def streaming_distribution() -> str | None:
    """Which distribution installed the `streaming` module (None: neither, e.g. a source checkout)."""
    for name in CHECKED_VERSIONS:
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return name
    return None


_distribution = streaming_distribution()
if _distribution is None or not streaming.__version__.startswith(CHECKED_VERSIONS[_distribution]):
    raise UserError(f"{_distribution or 'streaming'} {streaming.__version__} is installed; this project reaches into "
                    "its internals and is checked only against mosaicml-streaming 0.13.0 and streaming-community "
                    "0.14.x: pip install 'tokstream[mosaicml]' (mosaicml-streaming==0.13.0) or "
                    "'tokstream[community]' (streaming-community 0.14)")

_LOCAL = int(_ShardState.LOCAL)  # plain ints: IntEnum comparisons are slow per sample
_REMOTE = int(_ShardState.REMOTE)
_PREPARING = int(_ShardState.PREPARING)

# Names of the shared-memory blocks and /tmp lock files streaming creates per dataset prefix.
SHM_BLOCK_SUFFIXES = tuple(SHM_TO_CLEAN)
LOCALS_BLOCK = LOCALS
LOCK_FILE_SUFFIXES = (BARRIER_FILELOCK, CACHE_FILELOCK)


def install_epoch_order(get_sampling, get_shuffle_py1e, generate_work_random) -> None:
    """Put the equal replacements (order/sampling.py, order/py1e.py, epoch_order.py) where streaming calls its own
    (install() does)."""
    streaming_dataset_module.get_sampling = get_sampling  # the name resample_streams calls
    streaming_shuffle_module.algos["py1e"] = get_shuffle_py1e  # streaming's registry of shuffle algorithms
    streaming_batching_module.batching_methods["random"] = generate_work_random  # and of batching methods


# How an order file's epoch is computed (streaming_door.order_file_sequence), set by install().
_order_file_sequence = None


def install_order_file_sequence(compute) -> None:
    global _order_file_sequence
    _order_file_sequence = compute


def kept_as_files(dataset: StreamingDataset) -> bool:
    """Whether the dataset reads its epochs' orders from files (order/order_files.py): an order_dir, one of streaming's
    own shuffles (the lazy orders compute their own), random batching, orig or relaxed partition, no replication,
    stock's resampling."""
    from tokstream.reader.order import LAZY_ORDERS

    return (bool(getattr(dataset, "order_dir", None)) and bool(dataset.shuffle)
            and dataset.shuffle_algo not in LAZY_ORDERS
            and dataset.batching_method == "random" and dataset.partition_algo in ("orig", "relaxed")
            and not dataset.replication
            and type(dataset).resample_streams is StreamingDataset.resample_streams)  # its inputs say it all


def order_inputs(dataset: StreamingDataset):
    """What an order file of the dataset's epochs depends on, with the door's way of computing it."""
    from tokstream.reader.order.order_files import OrderInputs

    if _order_file_sequence is None:
        raise RuntimeError("order files need the door installed (streaming_door.install())")
    return OrderInputs.of(dataset, _order_file_sequence)


def shuffle_names() -> list[str]:
    """The shuffle algorithms streaming knows (data.shuffle_algo), the project's own included."""
    from tokstream.reader.order import LAZY_ORDERS

    return sorted({*streaming_shuffle_module.algos, *LAZY_ORDERS})


def install_shuffle(name: str, get_shuffle_function) -> None:
    """Register a shuffle of the project's under its own name in streaming's registry (install() does), so that
    any StreamingDataset given shuffle_algo=name reads in that order; stock's own algorithms stay as they are."""
    if name in streaming_shuffle_module.algos and streaming_shuffle_module.algos[name] is not get_shuffle_function:
        raise RuntimeError(f"streaming already has a shuffle named {name!r}")
    streaming_shuffle_module.algos[name] = get_shuffle_function


def install_reader_from_json(reader_from_json) -> None:
    """Make datasets built from now on build their shards' readers with lean_readers.py's (install() does)."""
    streaming_stream_module.reader_from_json = reader_from_json  # the name Stream.get_shards calls


def install_spanner(spanner_class) -> None:
    """Make datasets built from now on use lean_spanner.py's Spanner (install() does)."""
    streaming_dataset_module.Spanner = spanner_class  # the name StreamingDataset.__init__ calls


class NodeBarrier(streaming_barrier_module.SharedBarrier):
    """streaming's barrier of a node's processes, whose waits end in one line when one of them has ended.

    Every process reading a dataset on a node passes it three times when an iteration starts (each epoch, each
    evaluation). Stock's two waits (for the last barrier's stragglers to leave, then for everyone to arrive) poll
    each TICK without a timeout: a rank that ended just before (a crash, a failed device, an error of its own) left
    the node's others waiting until killed: 30 s under torchrun (its agent's SIGTERM, which a waiting rank cannot
    act on, then SIGKILL), until the job's time limit under srun without --kill-on-bad-exit. Here each wait also
    looks, every LOOK_EVERY_S, at the processes recorded as owners of the dataset's registration on this node
    (stale_shm.py), and raises PeerEnded when one has released it or was killed and the wait is still on.

    `__call__` is stock's protocol on stock's shared fields (0.13 and community 0.14 alike): processes of a node
    that run the stock class and this one still meet. Only the waits differ.
    """

    ended_owners = staticmethod(lambda prefix, registration: [])  # install_node_barrier's: stale_shm.ended_owners
    locals_registration = staticmethod(lambda prefix: None)  # and stale_shm.locals_registration

    def __init__(self, filelock_path: str, shm_name: str) -> None:
        super().__init__(filelock_path, shm_name)
        self.prefix = int(os.path.basename(shm_name)[:6])  # _get_path(prefix, BARRIER): "NNNNNN_barrier"
        # The inode of the prefix's locals block, registered (or attached to) just before the dataset makes its
        # barrier: the node's first rank may take the block with it when it ends. Workers inherit it.
        self.registration = self.locals_registration(self.prefix)

    def __call__(self, num_procs: int) -> None:
        with self.lock:
            if self.num_exit == -1:  # the first use: the number of processes is set once
                self.num_exit = num_procs
        self.lock.acquire()
        if self.num_enter == 0:  # the first to arrive: wait for the last barrier's processes to have left it
            self.lock.release()
            self.wait_while(lambda: self.num_exit != num_procs)
            self.lock.acquire()
            self.flag = False  # then close the gate
        self.num_enter += 1
        if self.num_enter == num_procs:  # the last to arrive: reset the counts and open the gate
            self.num_enter = 0
            self.num_exit = 0
            self.flag = True
        self.lock.release()
        self.wait_while(lambda: not self.flag)
        with self.lock:
            self.num_exit += 1
            if self.num_exit == num_procs:
                self.num_exit = -1

    def wait_while(self, waiting) -> None:
        next_look = time.monotonic() + LOOK_EVERY_S
        while waiting():
            time.sleep(TICK)
            if time.monotonic() < next_look or self.registration is None:
                continue
            next_look = time.monotonic() + LOOK_EVERY_S
            # Still waiting after the look: one who ended after the wait was over is not this barrier's concern.
            if (ended := self.ended_owners(self.prefix, self.registration)) and waiting():
                raise PeerEnded(f"process {', '.join(map(str, ended))}, which read this dataset on this node "
                                f"(another rank of the job), ended or closed it while this process (pid "
                                f"{os.getpid()}) waited for it at the start of an epoch: the job cannot go on "
                                "without it; relaunch the job (training resumes from its last checkpoint)")


LOOK_EVERY_S = 0.2  # a look is a glob of /dev/shm and a read of /proc/PID/stat per owner: well under a millisecond


def install_node_barrier(ended_owners, locals_registration) -> None:
    NodeBarrier.ended_owners = staticmethod(ended_owners)
    NodeBarrier.locals_registration = staticmethod(locals_registration)
    streaming_dataset_module.SharedBarrier = NodeBarrier  # the name StreamingDataset.__init__ makes its barrier from


def install_file_lock() -> None:
    streaming_dataset_module.FileLock = PromptFileLock  # the name a dataset's cache lock (0.13: and barrier's) comes from
    streaming_barrier_module.FileLock = PromptFileLock  # and a barrier's own (streaming-community 0.14 makes it there)


class SizedBlock(streaming_memory_module.BuiltinSharedMemory):
    """A shared-memory block that, attached while its creator has created but not yet sized it, waits for the size.

    Stock's SharedMemory, asked to create a block that exists, sleeps one TICK (7 ms) and attaches: every rank of a
    node creates a dataset's barrier and arrays that way, whichever comes first. A creator descheduled between
    creating the block and sizing it for longer than that (a loaded node) leaves it empty, and the attach fails
    with "cannot mmap an empty file", ending the job at start."""

    def __init__(self, name: str | None = None, create: bool = False, size: int = 0):
        waited = 0.0
        while True:
            try:
                super().__init__(name, create, size)
                return
            except ValueError as err:
                if create or "empty file" not in str(err) or waited >= SIZING_WAIT_S:
                    raise
            if self._fd >= 0:  # the failed attach's descriptor
                os.close(self._fd)
                self._fd = -1
            time.sleep(TICK)
            waited += TICK


SIZING_WAIT_S = 60.0  # a creator stopped that long between creating a block and sizing it is taken as dead


def install_sized_attach() -> None:
    streaming_memory_module.BuiltinSharedMemory = SizedBlock  # the name streaming's SharedMemory creates blocks from


def install_prefix_registration(get_shm_prefix) -> None:
    """Make datasets built from now on number their blocks with prefix_registration.py's (install() does)."""
    streaming_dataset_module.get_shm_prefix = get_shm_prefix  # the name StreamingDataset.__init__ calls


# Where POSIX shared memory blocks are files (Linux).
SHM_DIR = Path("/dev/shm")


def first_free_prefix(streams_local: list[str], streams_remote: list[str | None], retry: int) -> int:
    """The lowest prefix that no block and no lock file uses; raises if a running dataset uses one of our cache
    directories (with a remote), as stock's scan (streaming.base.shared.prefix) does, after `retry` ticks.
    Checks our own directories for duplicates first.

    Stock takes, for each kind of block, the lowest prefix without that kind, and the largest of those: a
    prefix still holding some block of another dataset could be taken. Since datasets release their blocks
    when they close (each process the blocks it created: a job's first rank may close before its others),
    a new dataset could attach to a block being released and read another's state, such as its next epoch,
    and start in another epoch than its resume state. Stock also attaches to every block it passes, with a
    cleanup registered with atexit: two file descriptors per block until exit, quadratic in a process that
    makes many datasets. Here /dev/shm is read by name, and a locals block as a file."""
    _check_self(streams_local)
    for attempt in range(1 + retry):
        try:
            return _free_prefix(streams_local, streams_remote)
        except ValueError:
            if attempt == retry:
                raise
            time.sleep(TICK)


def _free_prefix(streams_local: list[str], streams_remote: list[str | None]) -> int:
    used = prefixes_in_shared_memory()
    prefix = 0
    while True:
        locks = (Path(gettempdir(), _get_path(prefix, lock)) for lock in (BARRIER_FILELOCK, CACHE_FILELOCK))
        if prefix not in used and not any(lock.exists() for lock in locks):
            return prefix
        if prefix in used and any(streams_remote):
            try:
                theirs = locals_of_block((SHM_DIR / _get_path(prefix, LOCALS).lstrip("/")).read_bytes())
            except (FileNotFoundError, PermissionError):
                theirs = []
            if any(local in theirs and remote is not None for local, remote in zip(streams_local, streams_remote)):
                raise ValueError(f"Reused local directory: {streams_local} vs {theirs}. Provide a different one.")
        prefix += 1


def prefixes_in_shared_memory(names: list[str] | None = None) -> set[int]:
    """The prefixes that some block of streaming's kinds in /dev/shm (or among `names`) belongs to."""
    found = set()
    for name in os.listdir(SHM_DIR) if names is None else names:
        number, _, kind = name.partition("_")
        if kind in SHM_BLOCK_SUFFIXES and len(number) == 6 and number.isdigit():
            found.add(int(number))
    return found


def other_blocks_of(prefix: int) -> list[str]:
    """The blocks of `prefix` in /dev/shm other than its locals block."""
    start = f"{prefix:06d}_"
    return [name for name in os.listdir(SHM_DIR) if name.startswith(start) and name[len(start):] in SHM_BLOCK_SUFFIXES
            and name[len(start):] != LOCALS]


def shared_memory_blocks(dataset: StreamingDataset) -> list[SharedMemory]:
    """The shared-memory blocks a dataset holds (its prefix's locals, barrier, epoch, cache and shard
    arrays, resume state), found among its attributes and theirs."""
    found: list[SharedMemory] = []

    def walk(value: object, depth: int) -> None:
        if isinstance(value, SharedMemory):
            found.append(value)
        elif depth and hasattr(value, "__dict__") and not isinstance(value, type):
            for item in tuple(vars(value).values()):
                walk(item, depth - 1)
    # Copies of the attributes (tuple() takes them at once): the dataset's threads may still be adding some.
    for value in tuple(vars(dataset).values()):
        walk(value, 2)
    return found


def release_shared_memory(blocks: list[SharedMemory], owner_pid: int) -> None:
    """What stock does for each block at exit, now: unlink the blocks this process created (a node's first
    rank), close the ones it attached to, and drop their atexit cleanup, which kept them (two file
    descriptors each, and their names in /dev/shm) until exit. Only in the process that made the dataset: a
    DataLoader worker's forked copy leaves the rank's blocks alone."""
    if os.getpid() != owner_pid:
        return
    for block in blocks:
        if getattr(block, "tokstream_released", False):
            continue
        block.tokstream_released = True
        atexit.unregister(block.cleanup)
        block.cleanup()


def locals_block_name(prefix: int) -> str:
    """The name (in /dev/shm) of the block that registers a prefix's cache directories."""
    return _get_path(prefix, LOCALS)


def epoch_order_in_force(get_sampling, get_shuffle_py1e, generate_work_random) -> bool:
    return (streaming_dataset_module.get_sampling is get_sampling
            and streaming_shuffle_module.algos["py1e"] is get_shuffle_py1e
            and streaming_batching_module.batching_methods["random"] is generate_work_random)


def file_locks(dataset: StreamingDataset, timeout_s: float = 30.0) -> list[FileLock]:
    """The dataset's barrier and cache file locks, once it has been iterated (tests). Stock makes the cache lock when
    its download-ahead thread first prepares a shard, which on a loaded machine may come after the first batch
    (a local shard is read without it): wait for it."""
    deadline = time.monotonic() + timeout_s
    while not hasattr(dataset, "_cache_filelock") and time.monotonic() < deadline:
        time.sleep(0.01)
    return [dataset._shared_barrier.lock, dataset._cache_filelock]


def shard_is_local(dataset: StreamingDataset, shard_id: int) -> bool:
    """Whether streaming's shared state says the shard is downloaded (and not being evicted)."""
    return dataset._shard_states[shard_id] == _LOCAL


def shards_are_local(dataset: StreamingDataset, shard_ids: np.ndarray) -> np.ndarray:
    """shard_is_local for many shards at once."""
    return dataset._shard_states.numpy()[shard_ids] == _LOCAL


def mark_shard_used(dataset: StreamingDataset, shard_id: int) -> None:
    """Tell streaming's least-recently-used eviction that the shard was just read."""
    if dataset.cache_limit:
        dataset._shard_access_times[shard_id] = time.time_ns()


def shard_of_samples(dataset: StreamingDataset, sample_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each sample's shard and its index in the shard (streaming's Spanner, for many ids at once)."""
    bounds = dataset.spanner.shard_bounds
    shards = np.searchsorted(bounds, sample_ids, side="right") - 1
    return shards, sample_ids - bounds[shards]


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


# How often a process waiting for one of streaming's file locks tries it again (filelock's default: 50 ms).
LOCK_POLL_S = 0.001


class PromptFileLock(FileLock):
    """A FileLock that a waiting process tries every millisecond instead of every 50 ms.

    Every rank and worker of a node passes streaming's shared barrier three times at each epoch start
    and resume, each time taking its file lock; with 8 ranks arriving together, most found it held
    and slept 50 ms at a time (0.1-0.2 s per start measured with 8 ranks on 2 cores, bench/scale.py).
    """

    def acquire(self, timeout=None, poll_interval=None, **kwargs):
        return super().acquire(timeout, LOCK_POLL_S if poll_interval is None else poll_interval, **kwargs)


# Streaming creates these locks lazily (a dataset must stay picklable until iterated), the cache's
# anew at every prepare_shard (it checks hasattr(self, "cache_filelock"), a name it never sets).


class ResumeStateKept(StreamingDataset):
    """StreamingDataset that answers its resume state from its own copy in the process that loaded it.

    Stock keeps a loaded state only in the node's `RESUME` shared-memory block, which whichever rank of
    the node loaded first created and unlinks when it closes or exits, and `state_dict` reads that block
    again to add the samples taken since. So a rank that ended first took the position with it: in a DDP
    loop where rank 0 alone saves, another rank that had left the loop made rank 0 save only the samples
    taken since the resume, and the next resume read those steps' samples again. In that process the
    block holds what it loaded (every rank of a node loads the same state, before reading), so its copy
    is the same answer without the block. DataLoader workers, other processes, read the block as stock.
    """

    _kept_resume_state: tuple[dict, int] | None = None  # (the state as the block holds it, the loading pid)

    def load_state_dict(self, obj: dict) -> None:
        super().load_state_dict(obj)
        self._kept_resume_state = json.loads(json.dumps(obj, sort_keys=True)), os.getpid()

    def _resume_incr_epoch(self) -> tuple[int, int]:
        """Stock's, and then every process of the node waits once more, for the node's first to have set the next
        epoch. In stock's, they leave the barrier together and the first sets it after: a process whose epoch was
        empty (resumed from a checkpoint at the epoch's end) started its next iterator at once, could read the old
        value and take the empty epoch again, one barrier ahead of the node's first: each then waited for the
        other (a rank at that barrier, another in DDP's all-reduce) for ever."""
        epoch, sample_in_epoch = super()._resume_incr_epoch()
        self._shared_barrier(self._unique_worker_world.workers_per_node)  # until the next epoch is set
        return epoch, sample_in_epoch

    def _resume(self, world: World, epoch: int) -> tuple[int, int]:
        kept, pid = self._kept_resume_state or (None, None)
        if kept is None or pid != os.getpid() or kept["epoch"] < epoch:  # none, not ours, or stale: stock's
            return super()._resume(world, epoch)
        # What stock's _resume does with the state it reads from the block.
        self.num_canonical_nodes = kept["num_canonical_nodes"]
        self.shuffle_seed = kept["shuffle_seed"]
        self.initial_physical_nodes = kept.get("initial_physical_nodes")
        self._set_shuffle_block_size(world)
        return kept["epoch"], kept["sample_in_epoch"]


class WindowedDownloadAhead(StreamingDataset):
    """StreamingDataset whose download-ahead threads step through the sample order a window at a time.

    streaming runs two background threads per iterator that walk the sample order one sample at a
    time (prepare: start downloads; ready: wait until each shard is local). At tens of thousands of
    samples per second their Python loops take the GIL from the consumer. These overrides keep
    streaming's logic, bounds and order but handle a window of samples at once, touching each
    shard once per window.

    They also end once the process's main thread has: streaming's own threads keep waiting for the
    consumer, and the interpreter's exit waits for them, so a DataLoader worker whose rank had ended
    or died hung at exit forever. (Workers ignore SIGTERM, so the DataLoader could not end them.)
    """

    order_dir: str | None = None  # where its epochs' orders are kept as files (order_files.py); None: stock's

    def _share_work(self, sample_ids: np.ndarray) -> tuple[SharedMemory, SharedMemory | None]:
        """Stock's, but the order is written into shared memory in place, not through a `tobytes()`
        copy of it (the node's first rank, at every epoch start: 70 MB at 8.8 M samples)."""
        if sample_ids.ndim != 5:
            raise ValueError(f"Sample IDs must be of 5D shape (num physical nodes, ranks per node, workers per rank, "
                             f"batches per worker, batch size). Instead, found as {sample_ids.ndim}D shape.")
        shape_shm = SharedMemory(name=_get_path(self._shm_prefix_int, EPOCH_SHAPE), create=True, size=5 * 8,
                                 auto_cleanup=False)
        shape_shm.buf[:5 * 8] = np.array(sample_ids.shape, np.int64).tobytes()
        if not sample_ids.size:  # the end of the epoch has been reached
            return shape_shm, None
        data_shm = SharedMemory(name=_get_path(self._shm_prefix_int, EPOCH_DATA), create=True,
                                size=sample_ids.size * 8, auto_cleanup=False)
        np.ndarray(sample_ids.shape, np.int64, buffer=data_shm.buf)[...] = sample_ids
        return shape_shm, data_shm

    def _get_work(self, epoch: int, sample_in_epoch: int):
        """Stock's, but for a dataset in the project's lazy shuffle the worker's ids are computed as they are read
        (order/lazy.py): no array of the epoch's size, nothing in shared memory, no wait for the node's first rank."""
        from tokstream.reader.order import order_files

        if not (in_lazy_order(self) or kept_as_files(self)):
            return super()._get_work(epoch, sample_in_epoch)
        world = self._parallel_worker_world
        ids = worker_ids(self, world.num_nodes, world.ranks_per_node, world.workers_per_rank, epoch, sample_in_epoch,
                         [(world.node, world.rank_of_node, world.worker_of_rank)],
                         say=self._unique_worker_world.is_local_leader)[0]
        if kept_as_files(self) and self._unique_worker_world.is_local_leader:
            order_files.build_ahead(order_inputs(self), epoch + 1, self.order_dir)
        return ids

    def prepare_shard(self, shard_id: int, blocking: bool = True) -> None:
        """Stock's, but a download that fails is undone, and a full disk evicts or is said as such.

        Stock leaves a shard whose download failed "being downloaded", so every thread and rank of the
        node that needs it waits for it forever: the rank that failed exits, and the others, stuck in
        that wait, never reach the step boundary where torchrun's SIGTERM would end them (they were
        SIGKILLed 30 s later). Here the shard goes back to remote and its partial file is removed:
        whoever needs it next tries again.

        With a cache_limit the disk caps it too: before a download, shards are evicted until the disk
        has room (stock counts a shard against the limit only once it is downloaded, so downloads in
        flight at once can take the disk past it), and a download that still finds the disk full
        evicts and tries again. Without one, or with nothing left to evict, a shard that does not fit
        ends the rank with one line that says how to make the cache fit.
        """
        while True:
            if self._shard_states[shard_id] == _REMOTE:
                make_room(self, shard_id)
            try:
                return super().prepare_shard(shard_id, blocking)
            except Exception as err:
                undo_download(self, shard_id)
                if not out_of_space(err):
                    raise
                if not (self.cache_limit and evicted_coldest(self)):
                    raise NoSpace(cache_full(self, shard_id)) from None

    def release_evicted(self) -> None:
        """Let go of whatever this process still holds of evicted shards, so that their disk space is
        freed (a reader that maps shards overrides this)."""

    def get_item(self, sample_id: int, retry: int = 7):
        raise_if_a_thread_failed(self)
        return super().get_item(sample_id, retry)

    def _each_sample_id(self, it) -> Iterator[list[int]]:
        """Stock's yield loop, but yielding the ids of `samples_per_item()` samples at a time: streaming's
        __iter__ passes each list to __getitem__, which a subclass reads as one item. At the end, the
        whole batches (of the dataset's batch_size) left are the last item; the rest is dropped, as a
        DataLoader's drop_last drops a partial batch."""
        group: list[int] = []
        size = self.samples_per_item()
        while not (it.should_exit() or self._event.is_set()):
            if it.yield_index == it.total:
                if whole := len(group) // self.batch_size * self.batch_size:
                    yield group[:whole]
                break
            if it.ready_index <= it.yield_index:
                time.sleep(TICK)
                continue
            stop = min(it.ready_index, it.yield_index + size - len(group))
            ids = it.sample_ids[it.yield_index:stop]
            group += ids[ids != -1].tolist()  # -1: padding in streaming's partition
            it.yield_index = stop
            if len(group) == size:
                yield group
                group = []
        raise_if_a_thread_failed(self)
        it.on_exit()

    def samples_per_item(self) -> int:
        """How many samples _each_sample_id groups into one item (a DataLoader batch or more)."""
        raise NotImplementedError

    def _prepare_thread(self, it) -> None:
        with failure_to_consumer(self):
            while not stopping(self, it):
                if it.prepare_index == it.total or it.ready_index == it.total:
                    it.prepare_index = it.total
                    break
                if far_enough_ahead(self, it.prepare_index, it):
                    time.sleep(TICK)
                    continue
                stop, shards = window(self, it, it.prepare_index)
                for shard_id in shards.tolist():
                    self.prepare_shard(shard_id, False)
                it.prepare_index = stop
        it.on_exit()

    def _ready_thread(self, it) -> None:
        with failure_to_consumer(self):
            while not stopping(self, it):
                if it.ready_index == it.total:
                    break
                if far_enough_ahead(self, it.ready_index, it):
                    time.sleep(TICK)
                    continue
                stop, shards = window(self, it, it.ready_index)
                if all(wait_until_local(self, it, shard_id) for shard_id in shards.tolist()):
                    it.ready_index = stop
        it.on_exit()


# The project's own helpers of the class above, outside streaming's class namespace: a later streaming
# version may add a method of any name to StreamingDataset, and a function here cannot collide with it.


def far_enough_ahead(dataset: StreamingDataset, index: int, it) -> bool:
    """Whether a thread that has reached `index` should sleep a tick.

    Stock moves again as soon as the consumer takes one sample, so at tens of thousands of
    samples a second its threads never sleep and keep taking the GIL from the consumer, which
    then reads far slower than with the threads idle. Here a thread moves once the consumer has
    taken a quarter of the predownload window since.
    """
    if dataset.predownload is None:
        return False
    return index - it.yield_index > dataset.predownload - dataset.predownload // 4


def stopping(dataset: StreamingDataset, it) -> bool:
    return it.should_exit() or dataset._event.is_set() or not threading.main_thread().is_alive()


def make_room(dataset: StreamingDataset, shard_id: int) -> None:
    """Before a download: with a cache_limit, evict until the disk has room for the shard and the
    downloads in flight (the disk caps the limit); without one, or with nothing left to evict, end
    here if the shard cannot fit, rather than after streaming's retries (15 s of backoff)."""
    shard = dataset.shards[shard_id]
    cache = os.path.join(shard.dirname, shard.split)
    if not os.path.isdir(cache) or os.path.exists(os.path.join(cache, shard.file_pairs[0][0].basename)):
        return  # nothing fetched yet (streaming makes the directory), or nothing to fetch
    block = os.statvfs(cache).f_frsize  # a file takes whole blocks of the disk
    sizes = -(-shard_sizes(dataset) // block) * block
    while True:
        free = shutil.disk_usage(cache).free
        # Room for one more download than is in flight: the other thread of this reader may start
        # one between this check and this download's start.
        in_flight = 0
        if dataset.cache_limit:
            in_flight = int(sizes[dataset._shard_states.numpy() == _PREPARING].sum()) + int(sizes.max())
        if free >= sizes[shard_id] + in_flight:
            return
        if dataset.cache_limit and evicted_coldest(dataset):
            continue
        if free < sizes[shard_id]:
            raise NoSpace(cache_full(dataset, shard_id))
        return  # room for this shard, if not for every download in flight: try


def in_lazy_order(dataset: StreamingDataset) -> bool:
    """Whether the dataset reads in the project's lazy order: its shuffle, with streaming's random batching, orig or
    relaxed partition, balanced sampling and no replication."""
    from tokstream.reader.order import LAZY_ORDERS

    return (bool(dataset.shuffle) and dataset.shuffle_algo in LAZY_ORDERS and dataset.batching_method == "random"
            and dataset.partition_algo in ("orig", "relaxed") and dataset.sampling_method == "balanced"
            and not dataset.replication)


def worker_ids(dataset: StreamingDataset, nodes: int, ranks_per_node: int, workers_per_rank: int, epoch: int,
               sample_in_epoch: int, workers: list[tuple[int, int, int]], say: bool = True) -> list:
    """For a dataset in the lazy order or with its orders kept as files: each (node, rank, worker)'s ids of the epoch
    from sample_in_epoch on, as streaming would hand them out, each slice computed when read (order/). `say`:
    whether this process warns of an order file it cannot write (a node's first worker does)."""
    from tokstream.reader.order import lazy_epoch_order
    from tokstream.reader.order import order_files
    from tokstream.reader.order.partition import WorkerIds, lazy_partition

    # The last epoch's order is kept: the ledger asks step after step of one epoch, and its set-up is O(shards).
    settings = (epoch, dataset.shuffle_algo, dataset.shuffle_block_size, dataset.shuffle_seed,
                dataset.num_canonical_nodes, dataset.sampling_method, dataset.sampling_granularity,
                tuple(stream.choose for stream in dataset.streams))
    kept = getattr(dataset, "_tokstream_epoch_order", None)
    if kept is not None and kept[0] == settings:
        order = kept[1]
    elif in_lazy_order(dataset):
        order = lazy_epoch_order(dataset.shuffle_algo, dataset.samples_per_shard, list(dataset.shards_per_stream),
                               [stream.choose for stream in dataset.streams], dataset.shuffle_seed, epoch,
                               dataset.num_canonical_nodes, dataset.shuffle_block_size)
    else:
        order = order_files.epoch_order(order_inputs(dataset), epoch, dataset.order_dir, say)
    dataset._tokstream_epoch_order = (settings, order)
    partition = lazy_partition(dataset.partition_algo, dataset.epoch_size, dataset.num_canonical_nodes, nodes,
                               ranks_per_node, workers_per_rank, dataset.batch_size, sample_in_epoch,
                               dataset.initial_physical_nodes)
    return [WorkerIds(order, partition, node, rank, worker) for node, rank, worker in workers]


def rank_orders(dataset: StreamingDataset, nodes: int, ranks_per_node: int, epoch: int,
                sample_in_epoch: int, limit: int | None = None) -> np.ndarray:
    """(ranks, samples): the ids each rank of `nodes` x `ranks_per_node` reads of `epoch` from `sample_in_epoch` on,
    in order, -1 past the end: the work a node's first rank computes (`_get_work`), for the whole world, with
    one worker per rank. More workers read the same ids, the rank's batches dealt out in turn, which the loader
    takes back in turn; the batch size only places the -1 padding. In the lazy order or from order files, only the
    first `limit` of each rank's are computed (all of them otherwise)."""
    world = World(num_nodes=nodes, ranks_per_node=ranks_per_node, workers_per_rank=1, worker=0)
    dataset._set_shuffle_block_size(world)  # what `_resume` does before the first epoch's work
    if in_lazy_order(dataset) or kept_as_files(dataset):
        ranks = [(node, rank, 0) for node in range(nodes) for rank in range(ranks_per_node)]
        return np.stack([ids[:limit] for ids in worker_ids(dataset, nodes, ranks_per_node, 1, epoch, sample_in_epoch,
                                                           ranks)])
    work = generate_work(dataset.batching_method, dataset, world, epoch, sample_in_epoch)
    return work.reshape(nodes * ranks_per_node, -1)


def build_order_files(dataset: StreamingDataset, epochs: range) -> list[Path]:
    """Build the epochs' order files of a dataset whose orders are kept as files (order_files.py) now, as a node's
    first worker would at each epoch's start; [] for a dataset read in another way (the lazy order needs none)."""
    from tokstream.reader.order import order_files

    if not kept_as_files(dataset):
        return []
    dataset._set_shuffle_block_size(World(num_nodes=1, ranks_per_node=1, workers_per_rank=1, worker=0))
    inputs = order_inputs(dataset)
    try:
        return [order_files.build(inputs, epoch, dataset.order_dir) for epoch in epochs]
    except order_files.NotKept as failed:
        raise UserError(f"data.order_dir {dataset.order_dir}: the epochs' orders cannot be built there "
                        f"({failed.reason}): give a folder with room, or leave the readers to build them") from None


def shard_sizes(dataset: StreamingDataset) -> np.ndarray:
    """Each shard's most bytes in the cache (raw, and compressed while it is unpacked), made once."""
    if getattr(dataset, "_tokstream_shard_sizes", None) is None:
        dataset._tokstream_shard_sizes = np.array([s.get_max_size() for s in dataset.shards], np.int64)
    return dataset._tokstream_shard_sizes


def cache_lock(dataset: StreamingDataset, timeout: float = -1) -> FileLock:
    """Stock's cache lock, as its own calls make it: a new one on the same file (flock excludes it)."""
    return PromptFileLock(dataset._cache_filelock_path, timeout=timeout)


def evicted_coldest(dataset: StreamingDataset) -> bool:
    """Evict the least recently used local shard; False if none is local."""
    with cache_lock(dataset):
        if not (dataset._shard_states.numpy() == _LOCAL).any():
            return False
        dataset._evict_coldest_shard()
    dataset.release_evicted()
    return True


def undo_download(dataset: StreamingDataset, shard_id: int) -> None:
    # Only this call's own download can fail with the shard PREPARING: a wait for another's raises
    # nothing. Stock's eviction can raise with the lock still held by this thread, through another
    # file descriptor, which would wait forever: a timeout leaves the shard as stock would.
    try:
        with cache_lock(dataset, timeout=10):
            if dataset._shard_states[shard_id] == _PREPARING:
                dataset._shard_states[shard_id] = _REMOTE
    except Timeout:
        pass
    shard = dataset.shards[shard_id]
    for pair in shard.file_pairs:
        for info in pair:
            if info is not None:  # stock downloaders write <file>.tmp, then rename it
                path = os.path.join(shard.dirname, shard.split, info.basename + ".tmp")
                try:
                    os.remove(path)
                except FileNotFoundError:
                    pass


def cache_full(dataset: StreamingDataset, shard_id: int) -> str:
    shard = dataset.shards[shard_id]
    cache = os.path.join(shard.dirname, shard.split)
    free = shutil.disk_usage(cache).free
    sizes = shard_sizes(dataset)
    largest = int(sizes.max())
    # What this dataset holds there and what is left, less the other splits' shards still to come
    # (each split is a dataset of its own, with its own cache_limit: one that finds the disk full
    # has none of the others' shards to evict), less what the cache takes beyond its limit: a shard
    # per download in flight (two threads per reader) and the evicted ones a reader still maps,
    # about 4 per reader process of the node.
    worker = get_worker_info()
    readers = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) * (worker.num_workers if worker else 1)
    # From the disk, not streaming's cache_usage, which counts a shard only once its reader has recorded it
    # (a download in flight, or just renamed into place, is not yet counted): a rank that met the full disk
    # in that window suggested a lower limit, or none. So every rank that meets it suggests the same.
    held = bytes_in_cache(cache)
    limit = free + held - other_splits_to_fetch(dataset) - 4 * readers * largest
    hint = (f"set data.cache_limit to at most {size_setting(limit)} (the least recently used shards are "
            "then evicted to stay under it, leaving room for the other splits and the downloads in flight), "
            "or point data.local at a bigger disk"
            if limit >= 4 * largest else "point data.local at a bigger disk")  # streaming's lowest limit
    return (f"{no_space(f'the data cache {cache}')}: a shard of {size_setting(int(sizes[shard_id]))} did not "
            f"fit in the {size_setting(free)} free there; {hint}")


def bytes_in_cache(cache: str) -> int:
    """The bytes a split's cache directory holds on disk now: its shards, and the partial files of downloads
    in flight (stock downloaders' `<file>.tmp`), whichever reader writes them."""
    total = 0
    for entry in os.scandir(cache):
        try:
            if entry.is_file(follow_symlinks=False):
                total += entry.stat().st_size
        except FileNotFoundError:  # evicted, renamed or undone meanwhile
            pass
    return total


def other_splits_to_fetch(dataset: StreamingDataset) -> int:
    """Bytes the other splits (val; train, seen from val) of this dataset's sources will take in the
    cache beside this split, for the shards they have not fetched yet (raw and compressed while it
    is unpacked), each at most the cache_limit they share with this one."""
    missing = 0
    for stream in dataset.streams:
        for split in Path(stream.local).iterdir():
            if split.name == stream.split or not (split / "index.json").is_file():
                continue
            to_fetch = sum(shard["raw_data"]["bytes"] + (shard["zip_data"] or {"bytes": 0})["bytes"]
                           for shard in index_shards(split)
                           if not (split / shard["raw_data"]["basename"]).exists())
            missing += min(to_fetch, dataset.cache_limit) if dataset.cache_limit else to_fetch
    return missing


@contextmanager

def failure_to_consumer(dataset: StreamingDataset) -> Iterator[None]:
    """A download-ahead thread's error is raised by the consumer (`_raise_if_a_thread_failed`) as it
    is: stock's callback only logs it, with a traceback, and the consumer then raises a generic one."""
    try:
        yield
    except Exception as err:
        if getattr(dataset, "_tokstream_thread_error", None) is None:
            dataset._tokstream_thread_error = err
        dataset._event.set()


def raise_if_a_thread_failed(dataset: StreamingDataset) -> None:
    if (err := getattr(dataset, "_tokstream_thread_error", None)) is not None:
        raise err


def window(dataset: StreamingDataset, it, start: int) -> tuple[int, np.ndarray]:
    """End of the window of samples from `start` within the predownload bound, and its shards in order."""
    ahead = dataset.predownload if dataset.predownload is not None else it.total
    stop = min(it.total, max(start + 1, it.yield_index + ahead + 1))
    ids = it.sample_ids[start:stop]
    shards = np.searchsorted(dataset.spanner.shard_bounds, ids[ids >= 0], side="right") - 1
    _, first = np.unique(shards, return_index=True)
    return stop, shards[np.sort(first)]


def wait_until_local(dataset: StreamingDataset, it, shard_id: int) -> bool:
    """Fetch the shard if it is remote and wait until it is local; False if the iterator is done first.

    Unlike streaming's own wait, this one re-fetches a shard evicted (back to REMOTE) while it
    waited, and gives up when the iterator exits (a new epoch, or process exit). Without both,
    a thread waiting on an evicted shard never ends and the process hangs at exit (seen on a
    loaded node with a small cache_limit).
    """
    while dataset._shard_states[shard_id] != _LOCAL:
        if stopping(dataset, it):
            return False
        if dataset._shard_states[shard_id] == _REMOTE:
            dataset.prepare_shard(shard_id, False)
        else:
            time.sleep(TICK)  # another thread or rank is downloading it
    return True


def size_setting(size: int) -> str:
    """A byte count as streaming's size settings take it (1024-based), rounded down: "12gb", "300kb"."""
    for suffix, unit in (("tb", 1 << 40), ("gb", 1 << 30), ("mb", 1 << 20), ("kb", 1 << 10)):
        if size >= 10 * unit:
            return f"{size // unit}{suffix}"
    return f"{size}b"
