"""Preemption: SIGTERM or SIGUSR1 on any rank makes every rank stop at the same step boundary."""

import signal
import time

import torch
import torch.distributed as dist

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionWatch:
    """Records a preemption signal; `should_stop` is a collective every rank calls once per step."""

    def __init__(self, device: torch.device):
        self.received: int | None = None
        self.noticed_at: float | None = None  # time.monotonic() of the signal here, or of hearing of another rank's
        self.device = device
        for signum in PREEMPTION_SIGNALS:
            signal.signal(signum, self._record)

    def _record(self, signum: int, frame: object) -> None:
        self.received = signum  # just a flag: the step in flight finishes normally
        self.noticed_at = time.monotonic()

    def should_stop(self) -> bool:
        flag = torch.tensor([1 if self.received is not None else 0], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # one rank signalled: all stop here
        stop = bool(flag.item())
        if stop and self.noticed_at is None:
            self.noticed_at = time.monotonic()
        return stop
