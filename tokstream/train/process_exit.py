"""A rank's exit without Python's teardown of torch: the same exit, 1-3 s sooner on every launch.

After the last step, a rank that returns normally spends seconds of CPU in the interpreter's finalization, mostly
freeing torch's and torch._dynamo's modules one object at a time (the optimizer imports torch._dynamo): 1.5-2.5 s per
process on the 2-core test machine, for every launch, preemption and requeue. Nothing of the project's is left to do
by then. `exit_without_teardown` does the two steps of a normal exit that matter, with the functions CPython's own
finalization calls for them (here alone): `threading._shutdown` (executors told to stop, then every non-daemon thread
joined) and `atexit._run_exitfuncs` (multiprocessing's children, weakref finalizers, logging, W&B). It then flushes
the standard streams and leaves with the status, skipping only the freeing of modules.
"""

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_without_teardown(status: int) -> NoReturn:
    """Exit with `status` as `sys.exit` would, without freeing the interpreter's modules first."""
    threading._shutdown()  # as a normal exit: executors' idle workers released, non-daemon threads joined
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or its reader gone: nothing more can reach it
            pass
    os._exit(status)
