"""Learning-rate schedule: linear warm-up, then cosine, linear or constant decay.

The rate is a pure function of the optimizer step, so resuming needs only the step
number (no scheduler object state), and the rate of step s is the same in an
interrupted and an uninterrupted run.
"""

from __future__ import annotations

import math


def default_warmup(total_steps: int) -> int:
    """5% of the run, at least one step when the run has more than one."""
    return max(1, round(0.05 * total_steps)) if total_steps > 1 else 0


def lr_at(
    step: int,
    *,
    peak_lr: float,
    total_steps: int,
    warmup_steps: int,
    schedule: str = "cosine",
    min_lr_ratio: float = 0.1,
) -> float:
    """Learning rate for optimizer step `step` (0-based: the rate used to take step step+1).

    Warm-up rises linearly from peak/warmup to the peak over `warmup_steps` steps;
    then the rate decays from the peak to `min_lr_ratio * peak` at the last step.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return peak_lr
    decay_steps = max(1, total_steps - warmup_steps - 1)
    progress = min(1.0, max(0.0, (step - warmup_steps) / decay_steps))
    floor = min_lr_ratio * peak_lr
    if schedule == "linear":
        return floor + (peak_lr - floor) * (1.0 - progress)
    if schedule == "cosine":
        return floor + (peak_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown schedule {schedule!r}")  # config validation prevents this
