"""The loss-spike guard (guard.zscore; docs/loss-spikes.md): a step whose loss or gradient norm stands more than
`zscore` standard deviations above the last `window` steps' is a spike. Off by default.

Every rank judges alike: the loss is the ranks' mean and the gradient norm is taken after the all-reduce. The window
is part of the checkpoint, so a resumed run judges each step as the uninterrupted run did. A spike does not enter the
window (it would widen the very deviation it is measured by).
"""

import math
from collections import deque

# Steps in the window before any step is judged: a deviation over fewer says little.
MIN_HISTORY = 16


class SpikeGuard:
    def __init__(self, zscore: float, window: int):
        self.zscore = zscore
        self.losses: deque[float] = deque(maxlen=window)
        self.norms: deque[float] = deque(maxlen=window)

    optional_in_checkpoints = True  # a checkpoint from before the guard resumes with an empty window

    def judge(self, loss: float, grad_norm: float) -> dict | None:
        """The step's z-scores when it is a spike (it stays out of the window); else None, and it joins the window."""
        scores = {"loss_z": _zscore(loss, self.losses), "grad_norm_z": _zscore(grad_norm, self.norms)}
        if any(score is not None and score > self.zscore for score in scores.values()) or not math.isfinite(loss):
            return {key: (round(score, 2) if score is not None else None) for key, score in scores.items()}
        self.losses.append(loss)
        self.norms.append(grad_norm)
        return None

    def state_dict(self) -> dict:
        return {"losses": list(self.losses), "norms": list(self.norms)}

    def load_state_dict(self, state: dict) -> None:
        self.losses.extend(state["losses"])
        self.norms.extend(state["norms"])


def _zscore(value: float, history: deque) -> float | None:
    if len(history) < MIN_HISTORY:
        return None
    mean = sum(history) / len(history)
    spread = math.sqrt(sum((x - mean) ** 2 for x in history) / len(history))
    if not math.isfinite(value):
        return math.inf
    return (value - mean) / spread if spread > 0 else (0.0 if value == mean else math.inf)
