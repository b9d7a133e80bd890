"""How micro-batches get from TokenDataset to the rank: stock StreamingDataLoader order, fewer hand-offs.

In the rank (num_workers=0) a micro-batch is stacked straight into the tensor the trainer copies
to the GPU: pinned memory when it will be (one copy, from the mapped shard to where the device
reads it), still in the dataset's dtype (widened on the device: data.to_device).

With DataLoader workers, every batch a worker sends costs a pickle, a pipe and a queue hop on both
sides, about 0.3 ms here: as much as reading the batch itself, so one worker ran at half the
in-process rate (bench/loader.py). Here a worker sends a *transfer* of several micro-batches at
once (at least TRANSFER_SAMPLES samples), and the rank puts the micro-batches back in the order
stock StreamingDataLoader yields them: the DataLoader takes one batch from each worker in turn
(worker 0, 1, ..., then round again), a worker that has run out drops out of the round. Streaming's
resume state counts the samples the rank has yielded, as stock streaming does, so a checkpoint
taken between any two micro-batches resumes exactly, whatever the workers had read ahead.

With `reuse_slots` (training's loop, which is done with a micro-batch once it asks for the next)
workers write their transfers into a shared ring the rank reads in place (transfer_ring.py), and
only ids cross the pipe.
"""

import atexit
import multiprocessing
import os
import signal
import threading
import time
import weakref
from collections.abc import Iterator

import torch

from tokstream.reader.streaming_door.streaming_import import import_streaming

import_streaming()  # before streaming is imported: without transformers and torchvision (streaming_import.py)
from streaming import StreamingDataLoader
from torch.utils.data import DataLoader

from tokstream.errors import NoSpace, PeerEnded, UserError
from tokstream.reader import streaming_door
from tokstream.reader.notices import NOTICES, notices_held
from tokstream.reader.token_dataset import TokenDataset
from tokstream.reader.transfer_ring import TransferRing

# 0.3 ms per hand-off over at least 256 samples: a few percent of a worker's time.
TRANSFER_SAMPLES = 256


def start_worker(worker_id: int) -> None:
    """A DataLoader worker's start.

    Workers share the rank's process group, which torchrun and schedulers signal; only the rank
    should react (it finishes the step and checkpoints), and a worker killed by SIGTERM would fail
    the rank's next batch: so workers ignore SIGTERM and SIGUSR1, and end by themselves instead.
    With their loader, the DataLoader's way; with their rank, here: the DataLoader's own watchdog
    sees a dead rank, but the worker then waits forever at exit for its queue's thread, blocked
    writing a batch into a pipe no one reads.
    """
    for signum in NOTICES:
        signal.signal(signum, signal.SIG_IGN)  # a notice held back since the fork (notices_held) is dropped here
    signal.pthread_sigmask(signal.SIG_UNBLOCK, NOTICES)
    streaming_door.install()  # a spawned worker starts from fresh modules (a forked one has it already)
    threading.Thread(target=_exit_with_rank, args=(os.getppid(),), name="exit-with-rank", daemon=True).start()


def _exit_with_rank(rank_pid: int) -> None:
    while os.getppid() == rank_pid:
        time.sleep(0.5)
    os._exit(0)  # the rank is gone: nothing this worker holds can reach it


# The DataLoader iterators with workers that are alive in this process.
_WITH_WORKERS: "weakref.WeakSet[DataLoader]" = weakref.WeakSet()


@atexit.register
def _end_workers() -> None:
    """At exit, end the workers of loaders still alive (a rank ending on an exception), the DataLoader's
    own way. multiprocessing's exit would SIGTERM them, which they ignore, and then wait for them forever."""
    for batches in list(_WITH_WORKERS):
        _end(batches)


def _end(batches) -> None:
    """End a DataLoader iterator's workers, the DataLoader's own way, then kill any still there."""
    if (ring := getattr(batches, "transfer_ring", None)) is not None:
        ring.close()  # a worker waiting for a slot would not see the DataLoader's end
    batches._shutdown_workers()
    for worker in getattr(batches, "_workers", []):
        # Still there: waiting in streaming for a worker that failed (its epoch order never comes), where it sees
        # neither the DataLoader's end nor the SIGTERM it ignores. Its reader is done with it: nothing it does matters.
        if worker.is_alive():
            worker.kill()
            worker.join(timeout=10)
    _WITH_WORKERS.discard(batches)


def _as_the_worker_said(err: Exception) -> Exception:
    """A DataLoader worker's one-line error as the worker raised it: the DataLoader re-raises it in the
    rank with the worker's whole traceback as its message, "Caught ... Original Traceback ...", which
    ends with the original line."""
    marker = f"{type(err).__module__}.{type(err).__qualname__}: "
    text = str(err)
    if not text.startswith("Caught ") or marker not in text:
        return err
    return type(err)(text.rsplit(marker, 1)[1].strip())


def _as_is(item: dict) -> dict:
    """The DataLoader's collate_fn: TokenDataset's items are batches already."""
    return item


def in_stock_order(transfers: Iterator[dict], num_workers: int, pin_memory: bool,
                   ring: TransferRing | None = None) -> Iterator[dict]:
    """The micro-batches of the workers' transfers in the order stock StreamingDataLoader yields them.

    Transfers arrive round by round (the DataLoader asks the workers in turn), each holding the next
    few micro-batches of its worker. A round is complete once the last worker has sent, or a transfer
    from an earlier worker (the next round) or the end shows that the later ones have run out. Its
    micro-batches are yielded interleaved: the first of each worker in worker order, then the second...
    """
    round_: list[dict] = []
    for transfer in transfers:
        if round_ and transfer["worker"] <= round_[-1]["worker"]:
            yield from _interleaved(round_)
            round_ = []
        round_.append(_as_tensors(transfer, pin_memory, ring))
        if transfer["worker"] == num_workers - 1:
            yield from _interleaved(round_)
            round_ = []
    yield from _interleaved(round_)


def _as_tensors(transfer: dict, pin_memory: bool, ring: TransferRing | None) -> dict:
    ids = torch.from_numpy(transfer["ids"])
    if "transfer" in transfer:  # written into the ring: read in place, pinned there if it could be
        tokens = ring.tokens(transfer["worker"], transfer["transfer"], ids.numel()).view(*ids.shape, -1)
        pin_memory = pin_memory and not ring.pinned
    else:
        tokens = torch.from_numpy(transfer["tokens"])
    if pin_memory and len(tokens):
        tokens = tokens.pin_memory()  # one copy per transfer; the micro-batches are views of it
    return {"worker": transfer["worker"], "tokens": tokens, "ids": ids}


def _interleaved(round_: list[dict]) -> Iterator[dict]:
    for index in range(max((len(transfer["ids"]) for transfer in round_), default=0)):
        for transfer in round_:
            if index < len(transfer["ids"]):
                yield {"tokens": transfer["tokens"][index], "ids": transfer["ids"][index]}


class TokenLoader(StreamingDataLoader):
    """StreamingDataLoader over a TokenDataset: the same micro-batches in the same order as stock, its
    state the same count of samples yielded. The dataset yields whole batches (token_dataset.py):
    micro-batches in the rank, transfers in workers (see the module)."""

    def __init__(self, dataset: TokenDataset, batch_size: int, num_workers: int, pin_memory: bool,
                 reuse_slots: bool = False, **kwargs):
        """`reuse_slots`: a micro-batch from a worker is valid only until the loader has yielded about two
        transfers more (transfer_ring.py); for a loop that copies each one to the device and moves on."""
        if dataset.batch_size != batch_size:
            raise ValueError(f"the dataset's batch_size {dataset.batch_size} is not the loader's {batch_size}")
        self.pins = pin_memory
        self.reuse_slots = reuse_slots
        dataset.pin_batches = pin_memory and not num_workers  # workers' batches are pinned on arrival
        dataset.transfer_samples = batch_size * max(1, -(-TRANSFER_SAMPLES // batch_size))
        super().__init__(dataset, batch_size=None, num_workers=num_workers, collate_fn=_as_is,
                         worker_init_fn=start_worker, **kwargs)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        self.num_samples_yielded = 0
        ring = self.dataset.ring = self._ring()  # before the workers fork: they inherit it
        with_workers = None
        try:
            with notices_held():  # the workers start here
                batches = DataLoader.__iter__(self)  # not StreamingDataLoader's: it would count transfers
            if ring is not None and self.pins:
                ring.pin()  # the workers have forked
            if self.num_workers:
                with_workers = batches
                _WITH_WORKERS.add(batches)
                batches.transfer_ring = ring
                batches = in_stock_order(batches, self.num_workers, self.pins, ring)
            for batch in batches:
                self.num_samples_yielded += len(batch["ids"])
                yield batch
        except (UserError, NoSpace, PeerEnded) as err:
            raise _as_the_worker_said(err) from None
        finally:
            self.dataset.ring = None
            if ring is not None:
                ring.close()
            if with_workers is not None:  # the epoch ended, was closed, or a worker's error ended it
                _end(with_workers)

    def _ring(self) -> TransferRing | None:
        """The ring this iteration's workers write into, where they will be forked from this process."""
        context = self.multiprocessing_context or multiprocessing
        if not (self.reuse_slots and self.num_workers and context.get_start_method() == "fork"):
            return None
        dtype, length = self.dataset.sample_format()
        return TransferRing(self.num_workers, (self.prefetch_factor or 2) + 3, self.dataset.transfer_samples,
                            length, dtype)
