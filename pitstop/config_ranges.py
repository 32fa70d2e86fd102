"""Range checks of every number in a RunConfig, kept apart from `config.validate`'s
cross-field checks (validate calls `range_problems`).

A NaN passes every `x <= 0` test and an infinity most others, and torch accepts both
until something breaks far from the flag: `--lr nan` trains nothing, `--save-minutes nan`
never saves, `--max-grad-norm nan` turns clipping off. So every float must be finite,
and each number is held to the range where it means something.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from pitstop.errors import short_repr

# Far above any real count of steps, tokens or rows, and still exact in a float and an
# int64: a bigger number is a typo that would overflow somewhere deep in numpy or torch.
MAX_COUNT = 2**53
# Range checks already in `validate` that a NaN or an infinity fails (no second message).
_CHECKED_IN_VALIDATE = {"min_lr_ratio"}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def range_problems(cfg: Any) -> list[str]:
    # `cfg` is a RunConfig; not imported here, as config imports this module
    """One message per number outside its range (validate's own checks are not repeated)."""
    p: list[str] = []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if isinstance(v, float) and not math.isfinite(v) and f.name not in _CHECKED_IN_VALIDATE:
            p.append(f"{_flag(f.name)} must be a finite number, got {short_repr(v)}")
        elif isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_COUNT:
            p.append(f"{_flag(f.name)} is {short_repr(v)}; it must be at most {MAX_COUNT:,}")

    def finite(name: str) -> float | None:
        v = getattr(cfg, name)
        return v if v is not None and math.isfinite(v) else None

    if (wd := finite("weight_decay")) is not None and wd < 0:
        p.append(f"--weight-decay must be 0 (off) or positive, got {wd}")
    if (drop := finite("lora_dropout")) is not None and not 0 <= drop < 1:
        p.append(f"--lora-dropout is a probability: at least 0 and below 1, got {drop}")
    if (alpha := finite("lora_alpha")) is not None and alpha <= 0:
        p.append(f"--lora-alpha must be positive, got {alpha}")
    if cfg.warmup_steps is not None and cfg.warmup_steps < 0:
        p.append(f"--warmup-steps must be 0 (no warm-up) or more, got {cfg.warmup_steps}")
    # The loader only uses prefetch_factor with worker processes (loader_workers None may
    # choose some), where torch refuses anything below 1 with a traceback.
    if cfg.prefetch_factor < 1 and cfg.loader_workers != 0:
        p.append(
            f"--prefetch-factor must be at least 1 with loader workers, got {cfg.prefetch_factor}"
        )
    if not 0 <= cfg.seed < 2**63:
        p.append(f"--seed must be between 0 and 2**63 - 1, got {short_repr(cfg.seed)}")
    return p
