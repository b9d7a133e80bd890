"""The learning-rate schedule: linear warmup, then cosine decay to min_lr; counted in steps, or in tokens
(optim.warmup_tokens and optim.decay_tokens), which a batch ramp does not stretch."""

import math

from tokstream.errors import UserError
from tokstream.train.config import TrainConfig


def in_tokens(config: TrainConfig) -> bool:
    """Whether the schedule counts tokens; refuses half of a token schedule."""
    optim = config.optim
    if (optim.warmup_tokens is None) != (optim.decay_tokens is None):
        given, missing = ("warmup_tokens", "decay_tokens") if optim.decay_tokens is None else (
            "decay_tokens", "warmup_tokens")
        raise UserError(f"optim.{given} is set but not optim.{missing}: a schedule in tokens needs both (the run's "
                        "start-up line gives its total tokens)")
    if optim.warmup_tokens is None:
        return False
    if not 0 <= optim.warmup_tokens < optim.decay_tokens:
        raise UserError(f"optim.warmup_tokens {optim.warmup_tokens} and optim.decay_tokens {optim.decay_tokens}: the "
                        "warm-up must end (from 0) before the decay does")
    return True


def learning_rate(step: int, config: TrainConfig, tokens_before: int = 0, step_tokens: int = 0) -> float:
    """The rate for optimizer step `step` (0-based), which trains on `step_tokens` after `tokens_before`.
    In steps, decay_steps defaults to max_steps."""
    optim = config.optim
    if in_tokens(config):
        done, at, warmup, decay = tokens_before + step_tokens, tokens_before, optim.warmup_tokens, optim.decay_tokens
    else:
        done, at, warmup, decay = step + 1, step, optim.warmup_steps, optim.decay_steps or config.max_steps
    if at < warmup:
        return optim.lr * min(done, warmup) / warmup
    if at >= decay:
        return optim.min_lr
    progress = (at - warmup) / max(1, decay - warmup)
    return optim.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (optim.lr - optim.min_lr)
