"""The preemption grace period: will a step plus the saves fit in it, and did the last save fit.

After a notice the run finishes the step in flight, waits for the background save in flight (if
any) and writes the final checkpoint; all of it must end before the platform's kill.
"""

import os
import time

import torch

from tokstream.train.run_store import RunStore, staging_path

PROBE_BYTES = 16 << 20
# torchrun's agent, when the notice reaches it too (a signal to its process group, a container being stopped),
# passes it on and kills its ranks this long after, whatever the platform's grace: torch.distributed.elastic's
# shutdown timeout, which torchrun offers no setting for.
TORCHRUN_SHUTDOWN_S = 30.0


def reachable_grace(grace_s: float, environ: dict = os.environ) -> tuple[float, str]:
    """(the grace a save can count on, what the lines add to say why): preempt_grace_s, at most torchrun's 30 s
    under torchrun (its ranks have TORCHELASTIC_RUN_ID; srun's and plain python's do not)."""
    if "TORCHELASTIC_RUN_ID" in environ and grace_s > TORCHRUN_SHUTDOWN_S:
        return TORCHRUN_SHUTDOWN_S, (f" (under torchrun at most {TORCHRUN_SHUTDOWN_S:g} s: when the notice reaches "
                                     "its agent, it kills the ranks that long after)")
    return grace_s, ""


def state_bytes(state: object) -> int:
    """Bytes of the tensors in a (nested) state dict, each storage once (tied weights): what a checkpoint writes."""
    storages: dict[int, int] = {}

    def visit(value: object) -> None:
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)

    visit(state)
    return sum(storages.values())


def measure_write_rate(store: RunStore) -> float:
    """Bytes per second of writing (and fsyncing, or uploading) a 16 MiB file to the run's store."""
    name = ".write-probe"
    staged = staging_path(store, name)
    began = time.perf_counter()
    try:
        with open(staged, "wb") as handle:
            handle.write(os.urandom(PROBE_BYTES))
            handle.flush()
            os.fsync(handle.fileno())
        store.publish(staged, name)
    finally:
        staged.unlink(missing_ok=True)  # a probe that failed (a full disk) leaves nothing behind
    seconds = time.perf_counter() - began
    store.remove([name])
    return PROBE_BYTES / max(seconds, 1e-6)


def budget_line(step_s: float, save_s: float, background: bool, grace_s: float,
                environ: dict = os.environ) -> tuple[bool, str]:
    """(fits, the line saying so): a step, the save in flight (background saving), the final save."""
    in_flight = save_s if background else 0.0
    need = step_s + in_flight + save_s
    reachable, why = reachable_grace(grace_s, environ)
    parts = f"a step {step_s:.1f} s + " + (f"a save in flight {in_flight:.1f} s + " if background else "")
    line = f"{parts}the final save {save_s:.1f} s = {need:.1f} s of preempt_grace_s={grace_s:g}{why}"
    if need <= reachable:
        return True, f"preemption: {line}"
    return False, (f"warning: a preemption notice would end in a kill: {line}; give the job a longer grace "
                   "period and set preempt_grace_s to it, or make the state smaller or the store faster")


def notice_line(step: int, save_s: float, since_notice_s: float, grace_s: float, environ: dict = os.environ) -> str:
    """How the preemption save went against the deadline."""
    reachable, why = reachable_grace(grace_s, environ)
    verdict = "within" if since_notice_s <= reachable else "PAST"
    return (f"saved checkpoint at step {step} in {save_s:.1f} s, {since_notice_s:.1f} s after the notice: "
            f"{verdict} preempt_grace_s={grace_s:g}{why}")
