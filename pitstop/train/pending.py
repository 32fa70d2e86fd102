"""Steps done but not yet logged: read from the device in one transfer, counted, turned
into metrics.jsonl lines.

The hot loop keeps each step's loss, gradient norm and flags as device tensors (no
host-device sync); at a logging step `device_values` reads all pending steps at once
(one collective over ranks, one transfer) and `account` counts them into the run state
and builds their lines.

metrics.jsonl, one line per optimizer step: step (1-based, steps done), epoch
(fractional), loss (mean CE per target token; null when skipped), lr, grad_norm,
skipped, trained_tokens / seen_tokens / padded_tokens (cumulative, all ranks),
step_trained_tokens, tokens_per_second (trained tokens of the step / step_seconds),
step_seconds, mfu (of the step's computed positions; null when the device peak is
unknown), and `<phase>_s` seconds per phase of the step; the last line of each
logging step also carries peak_memory_gib (the process's peak so far). A step that ran a
held-out evaluation (every --eval-steps, and the last step) also carries
eval_loss (mean CE per eval target token), eval_ppl (exp of it), eval_targets,
eval_sequences and eval_seconds on its own line; that evaluation's time is the
`eval_s` phase of the *next* step (like logging and checkpoints, it runs between
steps). TensorBoard and wandb get the same scalars (train/*, eval/*, time/<phase>,
memory/peak_gib: train/run_log.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pitstop.measure import flops as flops_mod
from pitstop.measure.timeline import StepRecord
from pitstop.train import distributed
from pitstop.train.state import RunState


@dataclass(frozen=True)
class Broken:
    """Why the run must stop at this line: the update broke the weights, or too many bad steps."""

    step: int
    lr: float
    loss: float
    norm: float
    weights: bool


@dataclass
class PendingStep:
    """One optimizer step not yet logged: its values stay device tensors until `device_values`.

    `counts` are this rank's (trained, seen, positions) tokens; `record` is the step's
    timeline (set when the step ends); `eval` the held-out result the step ran, if any.
    """

    step: int
    epoch: float
    lr: float
    loss: torch.Tensor
    grad_norm: torch.Tensor
    bad: torch.Tensor  # 0-dim bool: the update was skipped
    bad_run: torch.Tensor  # non-finite steps in a row, this one included
    weights_bad: torch.Tensor  # the update left non-finite weights on this rank
    counts: tuple[int, int, int]
    record: StepRecord | None = None
    eval: dict[str, float] = field(default_factory=dict)  # EvalResult's fields but `step`


def device_values(
    pending: list[PendingStep], env: distributed.DistEnv, device: torch.device
) -> list[list[float]]:
    """Per pending step: loss share, targets, seen, positions, ranks whose weights went
    non-finite (summed over ranks), then grad norm, bad, bad run (the same on every
    rank). One collective, one transfer."""

    def summed_row(p: PendingStep) -> torch.Tensor:
        counts = torch.tensor(p.counts, dtype=torch.float64).to(device)
        return torch.cat(
            [p.loss.double().reshape(1), counts, p.weights_bad.double().reshape(1).to(device)]
        )

    # float64 so the counts stay exact
    summed = torch.stack([summed_row(p) for p in pending])
    distributed.all_reduce_sum(summed, env)
    same = torch.stack(
        [torch.stack([p.grad_norm.double(), p.bad.double(), p.bad_run.double()]) for p in pending]
    )
    return torch.cat([summed, same], dim=1).tolist()


def _line(
    p: PendingStep,
    rec: StepRecord,
    phases: dict[str, float],
    state: RunState,
    *,
    loss: float,
    norm: float,
    skipped: bool,
    n_t: int,
    n_p: int,
    flops_per_token: float,
    peak_flops: float | None,
) -> dict[str, Any]:
    """The metrics.jsonl line of one step (the module docstring lists its fields)."""
    secs = rec.step_seconds
    # of the positions computed (padding included), as the summary's MFU
    mfu = flops_mod.mfu(n_p / secs, flops_per_token, peak_flops) if secs > 0 else None
    return {
        "step": p.step,
        "epoch": p.epoch,
        "lr": p.lr,
        **p.eval,
        "loss": None if skipped else loss,
        "grad_norm": norm,
        "skipped": skipped,
        "trained_tokens": state.trained_tokens,
        "seen_tokens": state.seen_tokens,
        "padded_tokens": state.padded_tokens,
        "step_trained_tokens": n_t,
        "tokens_per_second": n_t / secs if secs > 0 else None,
        "step_seconds": secs,
        "mfu": mfu,
        **{f"{k}_s": v for k, v in phases.items()},
    }


def account(
    pending: list[PendingStep],
    vals: list[list[float]],
    state: RunState,
    *,
    flops_per_token: float,
    peak_flops: float | None,
    max_bad_steps: int,
) -> tuple[list[dict[str, Any]], Broken | None]:
    """Count the pending steps into `state`; their metrics.jsonl lines. With a `Broken`,
    the lines end at the step that broke the run (what it wrote, nothing after)."""
    lines = []
    for p, (loss, n_t, n_s, n_p, w_bad, norm, bad, bad_run) in zip(pending, vals):
        rec = p.record
        assert rec is not None  # the loop sets it when the step ends, before any logging
        phases = rec.resolve()
        for k, v in phases.items():
            state.phase_totals[k] += v
        skipped = bool(bad)
        state.trained_tokens += int(n_t)
        state.seen_tokens += int(n_s)
        state.padded_tokens += int(n_p)
        line = _line(
            p,
            rec,
            phases,
            state,
            loss=loss,
            norm=norm,
            skipped=skipped,
            n_t=int(n_t),
            n_p=int(n_p),
            flops_per_token=flops_per_token,
            peak_flops=peak_flops,
        )
        lines.append(line)
        if w_bad:  # this update broke the weights: stop before anything saves them
            line["weights_finite"] = False
            return lines, Broken(p.step, p.lr, loss, norm, weights=True)
        if skipped:
            state.skipped_steps += 1
            state.bad_run = int(bad_run)
            if state.bad_run >= max_bad_steps:
                return lines, Broken(p.step, p.lr, loss, norm, weights=False)
        else:
            state.bad_run = 0
            state.last_loss, state.last_loss_step = loss, p.step
    return lines, None
