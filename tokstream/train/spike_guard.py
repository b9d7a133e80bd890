"""The loss-spike guard (guard.zscore; docs/loss-spikes.md): a step whose loss or gradient norm stands more than
`zscore` standard deviations above the last `window` steps' is a spike. Off by default.

Every rank judges alike: the loss is the ranks' mean and the gradient norm is taken after the all-reduce. The window
is part of the checkpoint, so a resumed run judges each step as the uninterrupted run did. A spike does not enter the
window (it would widen the very deviation it is measured by). The window starts again where the statistics move by
design: at a phase that changes the data, batch or block, and after a rewind.
"""

import json
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
        finite = math.isfinite(loss) and math.isfinite(grad_norm)  # a NaN or inf is a spike, window or not
        if any(score is not None and score > self.zscore for score in scores.values()) or not finite:
            return {key: (round(score, 2) if score is not None else None) for key, score in scores.items()}
        self.losses.append(loss)
        self.norms.append(grad_norm)
        return None

    def reset(self) -> None:
        """Judge from here on against what comes next: a phase that changes the data, batch or block, or a rewind."""
        self.losses.clear()
        self.norms.clear()

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


def skips_with_spike(skips: list[list[int]], spike: int, skip: int, max_steps: int) -> list[list[int]] | None:
    """skip_steps that also leave out `skip` steps' data from the spike's on: sorted, overlaps joined, none past
    max_steps (the window is cut there). Elsewhere than in a skip, [spike, spike + skip - 1] is added. A spike inside
    a skip [a, b] read the data of step spike + (b - a + 1) (one jump per skip, at its first step): the skip grows
    by (spike - a) + `skip`, so that from step a on the run reads past that window. None where a skip ending at
    max_steps would still read the spike's own data."""
    skips = sorted([list(pair) for pair in skips])
    holding = next((pair for pair in skips if pair[0] <= spike <= pair[1]), None)
    if holding is not None:
        if holding[1] + spike - holding[0] + 1 > max_steps:
            return None
        holding[1] = min(holding[1] + spike - holding[0] + skip, max_steps)
    else:
        skips.append([spike, min(spike + skip - 1, max_steps)])
        skips.sort()
    return joined(skips)


def joined(skips: list) -> list[list[int]]:
    """Skips sorted, those that overlap joined into one."""
    merged: list[list[int]] = []
    for first, last in sorted([list(pair) for pair in skips]):
        if merged and first <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], last)
        else:
            merged.append([first, last])
    return merged


def rewind_plan(saved: list[int], spike: int, skips: list[list[int]], rewind: int, skip: int,
                max_steps: int) -> tuple[int | None, list[list[int]] | None, int, bool]:
    """Where to rewind after a spike at `spike`: the newest of the `saved` checkpoints at least `rewind` steps before
    it (or the nearest before it: `near`), with the skips and the spike's. The checkpoint comes before every skip that
    changes, which a relaunch must not have trained (`limit`: the last step it may be). (target or None, skips,
    limit, near); skips None where no skip can leave the spike's data out (skips_with_spike)."""
    new_skips = skips_with_spike(skips, spike, skip, max_steps)
    if new_skips is None:
        return None, None, spike - 1, False
    changed = [pair for pair in new_skips if pair not in [list(old) for old in skips]]
    limit = min((pair[0] for pair in changed), default=spike) - 1
    far = [step for step in saved if step <= min(limit, spike - 1 - rewind)]
    near = [step for step in saved if step <= limit]
    return (max(far) if far else max(near) if near else None), new_skips, limit, not far


def advice(saved: list[int], spike: int, skips: list[list[int]], rewind: int, skip: int, max_steps: int) -> str:
    """What to relaunch with after a spike at `spike` (guard.action stop): rewind_plan's checkpoint and skips."""
    target, new_skips, limit, near = rewind_plan(saved, spike, skips, rewind, skip, max_steps)
    if new_skips is None:
        holding = next([a, b] for a, b in skips if a <= spike <= b)
        return (f"no skip can: step {spike} is inside skip_steps {holding}, which reads the data of step "
                f"{spike + holding[1] - holding[0] + 1}, and leaving that out needs the skip to end past "
                f"max_steps={max_steps}: raise max_steps, or relaunch from an earlier checkpoint with other settings "
                "(a lower learning rate)")
    settings = "skip_steps=" + json.dumps(new_skips, separators=(",", ":"))
    if target is None:
        return f"no kept checkpoint comes before step {limit + 1}: train again in a new run_dir with {settings}"
    if near:
        return (f"relaunch with: resume_from={target} {settings} (no kept checkpoint is guard.rewind={rewind} steps "
                f"before it: step {target} is the newest before step {limit + 1})")
    return f"relaunch with: resume_from={target} {settings}"
