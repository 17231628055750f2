"""Learning rate at a given step: warmup, then cosine / linear / 1-sqrt decay to `min_decay_lr`.
A pure function of the step, so resuming needs nothing but the step number."""

from __future__ import annotations

import math
from typing import Any


def lr_at(step: int, sched: Any, train_steps: int) -> float:
    """LR for optimizer step `step` (0-based) under `optimizer.learning_rate_scheduler`."""
    peak = sched.learning_rate
    floor = sched.min_decay_lr
    # A warm-up longer than the run ends with it (a warning says).
    warmup = min(sched.lr_warmup_steps, train_steps)
    if step < warmup:
        return peak * (step + 1) / warmup if sched.lr_warmup_style == "linear" else peak
    start = warmup if sched.lr_decay_starting_step is None else sched.lr_decay_starting_step
    length = (train_steps - start) if sched.lr_decay_steps is None else sched.lr_decay_steps
    if step < start or sched.lr_decay_style == "constant":
        return peak
    # The decay covers steps start .. start + length - 1: the first at the peak, the last at the floor (a
    # decay of one step goes straight to the floor).
    progress = 1.0 if length <= 1 else min(1.0, (step - start) / (length - 1))
    shape = {
        "cosine": 0.5 * (1.0 + math.cos(math.pi * progress)),
        "linear": 1.0 - progress,
        "1-sqrt": 1.0 - math.sqrt(progress),
    }[sched.lr_decay_style]
    return floor + (peak - floor) * shape
