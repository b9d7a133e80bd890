"""The learning-rate schedule: linear warmup, then cosine decay to min_lr."""

import math

from tokstream.train.config import TrainConfig


def learning_rate(step: int, config: TrainConfig) -> float:
    """The rate for optimizer step `step` (0-based); decay_steps defaults to max_steps."""
    optim = config.optim
    decay_steps = optim.decay_steps or config.max_steps
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    if step >= decay_steps:
        return optim.min_lr
    progress = (step - optim.warmup_steps) / max(1, decay_steps - optim.warmup_steps)
    return optim.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (optim.lr - optim.min_lr)
