"""A preemption's notices (SIGTERM, SIGUSR1) are the rank's alone: it finishes its step and checkpoints. Schedulers
send them to every process of the rank (Slurm's `--signal=USR1@180` and `scancel --signal` signal each process of
a job step, a pod's stop the process group), so the processes a rank starts must not die of them. (torch.compile's
compile workers still do: docs/slurm.md.)"""

import contextlib
import signal
import threading
from collections.abc import Iterator
from multiprocessing import resource_tracker

NOTICES = (signal.SIGTERM, signal.SIGUSR1)


@contextlib.contextmanager
def notices_held() -> Iterator[None]:
    """Notices held back in this thread while it starts a loader's workers. A worker inherits the mask: a notice sent
    to the rank's process group before the worker ignores it (start_worker) stays pending there and is dropped,
    where it would kill the worker (torch's handler re-raises SIGTERM's default action) and fail the rank's next
    batch mid-step. The rank gets its own notice once the workers are started."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals go to the main thread's handlers; other threads start no rank's workers
        return
    with _blocked_in_this_thread():
        yield


@contextlib.contextmanager
def _blocked_in_this_thread() -> Iterator[None]:
    """The notices blocked in the calling thread: a process it starts inherits that mask."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, NOTICES)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def start_resource_tracker() -> None:
    """multiprocessing's resource tracker (streaming's shared memory registers with it), started now with the notices
    blocked, before streaming starts it without. It ignores SIGTERM but not SIGUSR1: a time-limit notice killed it,
    and the tracker started again in its place printed a warning that resources might leak and a traceback for each
    block the rank later released. It leaves SIGUSR1 blocked, so a notice stays pending there for ever. A tracker
    already running (started by the user's code) is left as it is."""
    with _blocked_in_this_thread():  # from any thread: the tracker inherits the mask of the one that starts it
        resource_tracker.ensure_running()
