"""Streaming's epoch orders kept as files (data.order_dir): built once per epoch, memory-mapped by every rank.

In streaming's own orders (py1e and the others) the first rank of each node computes the whole epoch's order at
every epoch start and every resume: a minute or two and tens of GB per node at 880 M samples. Here the epoch's order
(position -> sample id, before the partition deals it out: epoch_order.epoch_sequence) is written once into
`order_dir` as a .npy file, uint32 where the ids fit, and every rank of this launch and of every relaunch maps it and
reads only its own positions, through the partition in closed form (partition.py). While an epoch is read, the
next one's file is built by a process of its own, so an epoch's end waits for nothing that was not already running.

The invariant: a file under an epoch's final name holds that epoch's whole order, for exactly the settings its name's
digest covers (the shards' sizes, the streams' draws, sampling, shuffle, seed, canonical nodes, block). It is written
under a partial name and renamed once complete and synced, and it ends with a checksum of its ids written as they were
computed: every process checks it (and that every id is a sample of the dataset) before it reads the file, so a file
damaged, edited or swapped since is rebuilt, with one line naming it, never read. A build that died leaves only its partial file, named
for its host, its pid and that process's start time; a later build removes it only when that process is provably
gone (same host, and no process with that pid and start time).
"""

import hashlib
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash
from filelock import FileLock, Timeout

from tokstream.errors import UserError

FORMAT = 2  # 2: a checksum after the ids
# After the array: this tag and the xxh3-128 digest of the array's bytes (np.load maps the array and ignores them).
CHECKSUM_TAG = b"tokstream-order\0"
CHECKSUM_BYTES = len(CHECKSUM_TAG) + 16


@dataclass
class _Stream:
    choose: int


@dataclass
class OrderInputs:
    """Everything an epoch's order depends on, under the names streaming's dataset gives them (the door's
    epoch_sequence reads it as it reads a dataset, with stock's resampling), and `compute`, the door's function that
    computes the order from them: picklable, so that a process of its own can build an epoch ahead."""

    samples_per_shard: np.ndarray
    shards_per_stream: list[int]
    chooses: list[int]
    sampling_method: str
    sampling_granularity: int
    epoch_seed_change: bool
    shuffle: bool
    shuffle_algo: str
    shuffle_seed: int
    num_canonical_nodes: int
    shuffle_block_size: int
    compute: Callable[["OrderInputs", int], np.ndarray] = field(repr=False, compare=False)
    streams: list[_Stream] = field(init=False)

    def __post_init__(self) -> None:
        self.samples_per_shard = np.asarray(self.samples_per_shard, np.int64)
        self.streams = [_Stream(choose) for choose in self.chooses]
        self.num_streams = len(self.shards_per_stream)
        self.shard_offset_per_stream = np.concatenate([[0], np.cumsum(self.shards_per_stream)[:-1]]).astype(np.int64)
        self.sample_offset_per_shard = np.concatenate([[0], np.cumsum(self.samples_per_shard)[:-1]]).astype(np.int64)
        self.epoch_size = int(sum(self.chooses))

    @classmethod
    def of(cls, dataset, compute) -> "OrderInputs":
        return cls(dataset.samples_per_shard, [int(n) for n in dataset.shards_per_stream],
                   [int(stream.choose) for stream in dataset.streams], dataset.sampling_method,
                   int(dataset.sampling_granularity), bool(dataset.epoch_seed_change), bool(dataset.shuffle),
                   dataset.shuffle_algo, int(dataset.shuffle_seed), int(dataset.num_canonical_nodes),
                   int(dataset.shuffle_block_size), compute)

    def digest(self) -> str:
        described = {key: getattr(self, key) for key in ("shards_per_stream", "chooses", "sampling_method",
                                                         "sampling_granularity", "epoch_seed_change", "shuffle",
                                                         "shuffle_algo", "shuffle_seed", "num_canonical_nodes",
                                                         "shuffle_block_size")}
        described["format"] = FORMAT
        described["samples_per_shard"] = hashlib.sha256(self.samples_per_shard.astype("<i8").tobytes()).hexdigest()
        return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:24]


def order_path(inputs: OrderInputs, epoch: int, directory: str | Path) -> Path:
    return Path(directory) / f"order-{inputs.digest()}-epoch-{epoch}.npy"


class OrderFile:
    """An epoch's order from its file: the sample at each position, read from the mapped file."""

    def __init__(self, path: Path, epoch_size: int):
        try:  # checked by build() in this launch before any process maps it
            self.ids = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as err:
            raise UserError(f"{path} is not an epoch order this project wrote ({err}): remove it, and it is built "
                            "again") from None
        if self.ids.shape != (epoch_size,):
            raise UserError(f"{path} changed while this run read it (it holds {self.ids.shape}, not an epoch order "
                            f"of {epoch_size} samples): remove it, and it is built again")
        self.path, self.epoch_size = path, epoch_size

    def __reduce__(self):  # mapped again where it is unpickled, not copied whole into the pickle
        return OrderFile, (self.path, self.epoch_size)

    def at(self, positions: np.ndarray) -> np.ndarray:
        return self.ids[positions].astype(np.int64)


class OrderInMemory:
    """An epoch's order computed in this process, where its file could not be written."""

    def __init__(self, ids: np.ndarray):
        self.ids, self.epoch_size = ids, len(ids)

    def at(self, positions: np.ndarray) -> np.ndarray:
        return self.ids[positions]


def epoch_order(inputs: OrderInputs, epoch: int, directory: str, say: bool = True) -> OrderFile | OrderInMemory:
    """The epoch's order of the dataset, from its file, built first if there is none (one process at a time: the
    others wait for it and map it). Where the file cannot be written (no room, not a folder, no permission) each
    process computes the same order in memory, and `say`s so once: the files only save work."""
    try:
        path = build(inputs, epoch, directory)
    except NotKept as failed:
        if say and directory not in _said:
            _said.add(directory)
            warnings.warn(f"data.order_dir {directory}: the epoch's order cannot be kept there ({failed.reason}); "
                          "each reader computes it in memory until there is", stacklevel=2)
        if failed.sequence is not None:
            return OrderInMemory(failed.sequence)
        return OrderInMemory(inputs.compute(inputs, epoch))
    return OrderFile(path, inputs.epoch_size)


_said: set[str] = set()  # the order_dirs a warning was given for, in this process


class NotKept(Exception):
    """An epoch's order file could not be written: why, and the order if it was computed before the write failed."""

    def __init__(self, reason: str, sequence: np.ndarray | None = None):
        super().__init__(reason)
        self.reason, self.sequence = reason, sequence


def _reason(err: OSError) -> str:
    return err.strerror or str(err)


def build(inputs: OrderInputs, epoch: int, directory: str | Path, wait: bool = True) -> Path | None:
    """The epoch's order file, checked, built if it is not there yet or fails its check (with one line saying so).
    With `wait` False, None at once if another process is building it."""
    path = order_path(inputs, epoch, directory)
    if path.exists() and problem_with(path, inputs) is None:
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(f"{path}.lock")
        lock.acquire(timeout=-1 if wait else 0)
    except Timeout:
        return None
    except OSError as err:
        raise NotKept(_reason(err)) from None
    try:
        if path.exists():  # built while this process waited, or damaged
            problem = problem_with(path, inputs)
            if problem is None:
                return path
            warnings.warn(f"{path} {problem}: it is not the order its name says; building it again", stacklevel=2)
        remove_dead_partials(path.parent)
        dtype = np.uint32 if inputs.samples_per_shard.sum() <= 1 << 32 else np.int64
        size = 128 + inputs.epoch_size * np.dtype(dtype).itemsize
        free = shutil.disk_usage(path.parent).free
        if free < 2 * size:  # leave the disk as much room as the file takes: a run's checkpoints may share it
            raise NotKept(f"{free:,} bytes free, and the file takes {size:,}")
        sequence = inputs.compute(inputs, epoch)
        partial = path.parent / f".{path.name}@{_process_tag(os.getpid())}.partial"
        try:
            _write(partial, sequence, dtype, path.name)
            os.rename(partial, path)
            directory_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(directory_fd)
            finally:
                os.close(directory_fd)
        except OSError as err:
            raise NotKept(_reason(err), sequence) from None
        finally:
            partial.unlink(missing_ok=True)  # this process's own partial file (gone once renamed)
        return path
    finally:
        lock.release()


def _write(partial: Path, sequence: np.ndarray, dtype: type, name: str) -> None:
    """The order as a .npy file and its checksum, synced (a full disk raises here, not at a later read of the mapped
    file). The checksum covers the file's final `name` (its settings' digest and epoch), then its ids: a whole file
    copied under another epoch's or settings' name fails it too."""
    digest = _checksum(name)
    with open(partial, "wb") as out:
        np.lib.format.write_array_header_1_0(out, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                                   "fortran_order": False, "shape": (len(sequence),)})
        for at in range(0, len(sequence), WRITE_CHUNK):
            chunk = sequence[at:at + WRITE_CHUNK].astype(dtype).tobytes()
            digest.update(chunk)
            out.write(chunk)
        out.write(CHECKSUM_TAG + digest.digest())
        out.flush()
        os.fsync(out.fileno())


def _checksum(name: str):
    """An order file's checksum before its ids: its final name's (the settings' digest and the epoch) first."""
    return xxhash.xxh3_128(name.encode())


def problem_with(path: Path, inputs: OrderInputs) -> str | None:
    """What is wrong with an epoch's order file (None: nothing): its shape and type, its checksum, and that every id
    is one of the dataset's samples. One pass over the file."""
    try:
        ids = np.load(path, mmap_mode="r")
        with open(path, "rb") as handle:
            handle.seek(-CHECKSUM_BYTES, os.SEEK_END)
            footer = handle.read(CHECKSUM_BYTES)
            size = handle.seek(0, os.SEEK_END)
    except (OSError, ValueError) as err:
        return f"cannot be read as an epoch order ({err})"
    if ids.shape != (inputs.epoch_size,) or ids.dtype not in (np.uint32, np.int64):
        return f"holds {ids.shape} {ids.dtype}, not an epoch order of {inputs.epoch_size} samples"
    if size != ids.offset + ids.nbytes + CHECKSUM_BYTES or not footer.startswith(CHECKSUM_TAG):
        return "has no checksum after its ids (cut short, or not written by this version)"
    digest, largest, smallest = _checksum(path.name), 0, 0
    for at in range(0, len(ids), WRITE_CHUNK):
        chunk = np.asarray(ids[at:at + WRITE_CHUNK])
        digest.update(chunk.tobytes())
        if len(chunk):
            largest, smallest = max(largest, int(chunk.max())), min(smallest, int(chunk.min()))
    if digest.digest() != footer[len(CHECKSUM_TAG):]:
        return "fails its checksum (changed since it was written, or written under another name)"
    samples = int(inputs.samples_per_shard.sum())
    if largest >= samples or smallest < 0:
        return f"holds sample id {largest if largest >= samples else smallest}, outside the dataset's {samples:,}"
    return None


WRITE_CHUNK = 1 << 22  # ids per write: bounds the converted copy


def _process_tag(pid: int) -> str | None:
    """host@pid@start: names a process for as long as its host runs (None when there is no such process here). A
    host name holds no "@"."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            start = stat.read().rsplit(")", 1)[1].split()[19]  # field 22, the start time in clock ticks since boot
    except (OSError, IndexError):
        return None
    return f"{socket.gethostname()}@{pid}@{start}"


def remove_dead_partials(directory: Path) -> None:
    """Remove the partial files of builds whose process is gone: written on this host by a pid that no longer runs,
    or runs as another process (another start time). Another host's partials are left: their process cannot be
    seen from here."""
    host = socket.gethostname()
    for partial in directory.glob(".order-*.partial"):
        parts = partial.name[:-len(".partial")].split("@")
        if len(parts) != 4 or parts[1] != host or not parts[2].isdigit():
            continue
        if _process_tag(int(parts[2])) != "@".join(parts[1:]):
            partial.unlink(missing_ok=True)


def build_ahead(inputs: OrderInputs, epoch: int, directory: str) -> None:
    """Start building the epoch's order in a process of its own, unless its file is there (its own lock keeps a second
    builder from doing it twice). It outlives the DataLoader worker that started it and ends when the file is built."""
    if order_path(inputs, epoch, directory).exists():
        return
    # The package's own root first on its path: a script run from elsewhere (train/main.py) put it on its own only.
    package_root = str(Path(__file__).resolve().parents[3])
    path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    builder = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True,
                               env={**os.environ, "PYTHONPATH": path})
    threading.Thread(target=builder.wait, daemon=True).start()  # reaped when it ends, while this process lives
    try:
        builder.stdin.write(pickle.dumps((inputs, epoch, str(directory))))
        builder.stdin.close()
    except BrokenPipeError:
        pass


if __name__ == "__main__":
    inputs, epoch, directory = pickle.loads(sys.stdin.buffer.read())  # inputs.compute: the door's, by reference
    try:
        build(inputs, epoch, directory, wait=False)
    except NotKept:
        pass  # the readers of that epoch find no file and build it, or say why they cannot
