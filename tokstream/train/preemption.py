"""Preemption: SIGTERM or SIGUSR1 on any rank makes every rank stop at the same step boundary."""

import os
import signal
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


# sysexits' EX_TEMPFAIL, "try again later": what a preempted rank exits with.
PREEMPTED_EXIT_STATUS = 75


class PreemptionWatch:
    """Records a preemption signal; `should_stop` is a collective every rank calls once per step. While `starting`
    (until the loop's first step: opening data, rewinding, downloading a checkpoint, building an epoch's order), a
    notice ends the rank at once with PREEMPTED_EXIT_STATUS and one line: nothing was trained, so nothing is saved,
    and start-up work can take longer than the notice's grace. What it leaves is what a kill leaves, which every
    start-up step is built to survive (atomic writes, partial files of dead processes removed, a rewind finished by
    the next launch)."""

    def __init__(self, device: torch.device | None = None):
        self.received: int | None = None
        self.noticed_at: float | None = None  # time.monotonic() of the signal here, or of hearing of another rank's
        self.device = device
        self.starting = True
        self._holding = 0  # how many whole() blocks are open
        self._held: int | None = None  # the notice that came inside them
        for signum in PREEMPTION_SIGNALS:
            signal.signal(signum, self._record)

    def _record(self, signum: int, frame: object) -> None:
        if self.starting and self._holding:
            self._held = signum
        elif self.starting:
            self._exit_starting(signum)
        else:
            self.received = signum  # just a flag: the step in flight finishes normally
            self.noticed_at = time.monotonic()

    @staticmethod
    def _exit_starting(signum: int) -> None:
        if os.environ.get("RANK", "0") == "0":
            os.write(1, f"preempted (signal {signum}) while starting: nothing trained in this launch, nothing to "
                        "save; exiting (a relaunch resumes from the run's newest checkpoint)\n".encode())
        os._exit(PREEMPTED_EXIT_STATUS)  # not an exception: a thread's download would hold it until done

    @contextmanager
    def whole(self):
        """A notice while starting waits for this block's end (a rewind's moves: milliseconds on a local disk), so
        that what the block does is done whole, and the launch ends after it; an error in the block is raised as
        it would be without a notice."""
        self._holding += 1
        try:
            yield
        finally:
            self._holding -= 1  # from here a notice ends the launch itself; one that came before is in _held
        if not self._holding and self._held is not None and self.starting:
            self._exit_starting(self._held)

    def should_stop(self) -> bool:
        flag = torch.tensor([1 if self.received is not None else 0], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # one rank signalled: all stop here
        stop = bool(flag.item())
        if stop and self.noticed_at is None:
            self.noticed_at = time.monotonic()
        return stop
