"""Worker batches written once, into memory the rank reads in place (pinned, for a GPU run).

Without this, a DataLoader worker's transfer (token_loader.py) is stacked into a worker array,
pickled through a pipe, unpickled in the rank and copied again into pinned memory: four copies of
every token before the one to the device. Here the rank maps one shared anonymous region before its
workers fork, registers it with CUDA as pinned host memory once they have forked when batches go
to a GPU, and cuts it into `slots` slots per worker. A worker stacks its n-th transfer's rows
straight into slot n % slots and sends only the ids and the slot's number; the rank's
micro-batches are views of it.

A slot is reused only once the rank has released it. The rank releases worker w's transfer n-2 when
transfer n arrives: by then every micro-batch of n-2 was yielded and its consumer asked for more,
so it has issued its copy to the device, and on a GPU the rank first waits for the CUDA event it
recorded after those copies (long complete by then). Micro-batches stay valid until then, which
is what a training loop needs, not what a loader whose batches are kept needs (see TokenLoader's
`reuse_slots`). A worker ahead of that waits; with `slots` >= 3 the transfer the rank waits for
never waits for a release. TokenLoader gives prefetch_factor + 3: the DataLoader asks a worker for
transfer n + prefetch_factor the moment the rank receives n, just before the rank releases n - 2,
and a worker that had to wait for that release lost a poll interval per transfer (with + 2, the
ring ran at 0.78-0.96 of pickled transfers in bench/loader.py; with + 3, 1.0-1.7). On a CPU the
DataLoader's own bound (prefetch_factor requests per worker) already keeps workers that far
behind; on a GPU the wait for the event is what keeps a slot from being rewritten under a copy in
flight.

Needs the workers forked from the rank (Linux's default start method), which is what shares the
region; elsewhere the loader keeps the pickled path.
"""

import mmap
import os
import time

import numpy as np
import torch

_POLL_S = 0.001


class TransferRing:
    """`workers` x `slots` slots of `rows` samples of `length` tokens of `dtype`, shared with forked workers."""

    def __init__(self, workers: int, slots: int, rows: int, length: int, dtype: np.dtype):
        if slots < 3:
            raise ValueError("a transfer ring needs at least 3 slots per worker (see the module)")
        self.workers, self.slots, self.rows, self.length, self.dtype = workers, slots, rows, length, np.dtype(dtype)
        self._slot_items = rows * length
        # MAP_SHARED anonymous memory: inherited by forked workers, gone with the last process that maps it.
        self._region = mmap.mmap(-1, workers * slots * self._slot_items * self.dtype.itemsize)
        self._control = mmap.mmap(-1, 8 * (workers + 1))
        self._released = np.frombuffer(self._control, dtype=np.int64)  # [w]: transfers of w released; [-1]: closed
        self._owner = os.getpid()
        self._tokens = torch.from_numpy(np.frombuffer(self._region, dtype=self.dtype))  # in place
        self._events: dict[tuple[int, int], torch.cuda.Event] = {}
        self.pinned = False
        self._sent: dict[int, int] = {}  # in a worker: transfers it has written, per worker id

    def _slot(self, worker: int, transfer: int) -> int:
        return (worker * self.slots + transfer % self.slots) * self._slot_items

    def pin(self) -> bool:
        """In the rank, once its workers have forked (CUDA may keep page-locked memory out of a forked
        child): page-lock the region for the GPU in place. False where CUDA cannot."""
        self.pinned = _register_pinned(self._tokens)
        return self.pinned

    # In a worker.

    def write(self, worker: int, rows: list[np.ndarray], check=None) -> int | None:
        """Stack `rows` into this worker's next slot, once the rank has released it; its transfer number,
        or None if the rank has closed the ring (it reads no more: the worker should end). `check`: called with
        the stacked (rows, length) array before the transfer is sent; what it raises, the worker raises."""
        transfer = self._sent.get(worker, 0)
        while self._released[worker] < transfer - self.slots + 1:
            if self._released[-1]:
                return None
            time.sleep(_POLL_S)
        start = self._slot(worker, transfer)
        out = np.frombuffer(self._region, dtype=self.dtype, count=len(rows) * self.length,
                            offset=start * self.dtype.itemsize)
        np.stack(rows, out=out.reshape(len(rows), self.length))
        if check is not None:
            check(out.reshape(len(rows), self.length))
        self._sent[worker] = transfer + 1
        return transfer

    # In the rank.

    def tokens(self, worker: int, transfer: int, samples: int) -> torch.Tensor:
        """The transfer's tokens, (samples, length), in place; marks the transfers of `worker` it frees."""
        self._record_and_release(worker, transfer)
        start = self._slot(worker, transfer)
        return self._tokens[start:start + samples * self.length].view(samples, self.length)

    def _record_and_release(self, worker: int, transfer: int) -> None:
        if self.pinned and transfer >= 1:  # after the copies of transfer-1's micro-batches were issued
            event = self._events[(worker, transfer - 1)] = torch.cuda.Event()
            event.record()
        if transfer >= 2:
            event = self._events.pop((worker, transfer - 2), None)
            if event is not None:
                event.synchronize()
            self._released[worker] = transfer - 1

    def close(self) -> None:
        """Tell waiting workers the rank reads no more, and unregister the pinned memory."""
        if os.getpid() != self._owner or self._released[-1]:
            return
        self._released[-1] = 1
        if self.pinned:
            torch.cuda.synchronize()  # no copy from the region may still be in flight
            torch.cuda.cudart().cudaHostUnregister(self._tokens.data_ptr())
            self.pinned = False


def _register_pinned(tokens: torch.Tensor) -> bool:
    """Page-lock the region for the GPU in place (cudaHostRegister); False where CUDA cannot."""
    if not torch.cuda.is_available() or not len(tokens):
        return False
    size = tokens.numel() * tokens.element_size()
    status = torch.cuda.cudart().cudaHostRegister(tokens.data_ptr(), size, 1)  # 1: cudaHostRegisterPortable
    return int(status) == 0
