"""Model FLOPs utilisation (MFU); the FLOPs per token come from the cost model.

The formula (6·N + 12·L·d·T, LoRA-aware) and the parameter counting of a loaded model
live in `pitstop.measure.cost_model` (one cost model for the trainer, the doctor and
the estimate); they are re-exported here for the callers that measure MFU.

MFU divides the achieved model FLOP/s by the device's peak (see `peak.py`); it uses
every position computed (padding included), since that is what the device did.
"""

from __future__ import annotations

from pitstop.measure.cost_model import FlopsModel, flops_model

__all__ = ["FlopsModel", "flops_model", "mfu"]


def mfu(
    positions_per_second: float, flops_per_token: float, peak_flops: float | None
) -> float | None:
    """Achieved model FLOP/s over the device's peak; None when the peak is unknown."""
    if not peak_flops or peak_flops <= 0:
        return None
    return positions_per_second * flops_per_token / peak_flops
