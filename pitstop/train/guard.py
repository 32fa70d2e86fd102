"""Finite weights: a step whose update makes any parameter NaN/Inf is caught without a sync.

The gradient-norm guard (trainer.optimizer_step) skips steps with non-finite gradients,
but a finite gradient can still produce non-finite weights (a huge learning rate, an
overflowing update). After each optimizer step `nonfinite_weights` computes, on the
device, whether any trainable parameter is non-finite, from each parameter's largest
magnitude, which propagates NaN and cannot overflow the way a 2-norm of large finite
weights would. On a GPU one fused pass (`_foreach_norm` with ord=inf); on a CPU each
parameter's `aminmax`, because torch's CPU inf-norm is ~13x slower: 11.23 against 0.87 ms
a step for the headline model's 8.4M parameters on a 2-core AMD EPYC (`python -m
bench.step_kernels --out bench/results/step_kernels-bf16.md`), 2% of that model's step.
The flag is read with the rest of the step's values at the logging step, which every
checkpoint and the final save run first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pitstop.core.errors import PitstopError


def nonfinite_weights(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """0-dim bool tensor on the parameters' device: True if any of them holds NaN/Inf.

    FSDP2 parameters are DTensors: each rank checks its own shard (log() sums the flags).
    """
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    local = [t.detach() for t in local if t.numel()]
    if not local:
        return torch.zeros((), dtype=torch.bool)
    if local[0].device.type == "cpu":
        extremes = [torch.stack(torch.aminmax(t)) for t in local]
        return ~torch.isfinite(torch.cat(extremes)).all()
    norms = torch._foreach_norm(local, float("inf"))
    return ~torch.isfinite(torch.stack(norms)).all()


def divergence_advice(precision: str, max_grad_norm: float) -> str:
    """What to try after non-finite steps, fitting this run (no fp16 advice on an fp32 run)."""
    tips = ["a lower --lr", "a longer warm-up (--warmup-steps)"]
    if not max_grad_norm > 0:
        tips.append("gradient clipping (--max-grad-norm 1)")
    if precision == "fp16":
        tips.append("--precision bf16 or fp32 instead of fp16 (its range overflows)")
    return "Try " + ", ".join(tips[:-1]) + " or " + tips[-1]


class TrainingDiverged(PitstopError):
    """Too many non-finite steps in a row, or an update that made the weights non-finite."""

    exit_code = 1


def diverged(
    *,
    step: int,
    lr: float,
    loss: float,
    norm: float,
    weights: bool,
    bad_run: int,
    last_checkpoint: Any,
    precision: str,
    max_grad_norm: float,
) -> TrainingDiverged:
    """The error that stops a run at optimizer step `step`, naming its last good checkpoint."""
    what = (
        f"the update of optimizer step {step} made weights non-finite (NaN/Inf; loss "
        f"{loss}, gradient norm {norm}, learning rate {lr:.3g}); they were not saved"
        if weights
        else f"{bad_run} optimizer steps in a row had a non-finite loss or gradient "
        f"(loss {loss}, gradient norm {norm}, learning rate {lr:.3g}); those steps were skipped"
    )
    return TrainingDiverged(
        f"training stopped at step {step}: {what}. The last good checkpoint is "
        f"{last_checkpoint or 'none (no checkpoint yet)'}. "
        + divergence_advice(precision, max_grad_norm)
    )
