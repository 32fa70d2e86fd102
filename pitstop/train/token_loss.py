"""The training loss: token cross-entropy summed over a micro-batch's targets, in fp32.

`F.cross_entropy(logits.float())` makes full-size passes over the [N, V] logits: an fp32
copy (a cast, under bf16 autocast), its log-softmax, and in the backward a zero-filled
[N, V] gradient, the log-softmax gradient and the cast back. On a CPU these passes are
bound by memory, not arithmetic: they took about a fifth of a training step of the
headline model (8k vocabulary, 2,048 positions per micro-batch; torch.profiler on the
dev box, 2026-11-24).

`chunked_token_ce` computes the same sum a block of rows at a time, so each block's fp32
temporaries stay in the CPU's cache, and it keeps no fp32 copy of the logits for the
backward (it saves the logits as they are and each row's log-sum-exp). Its gradient is
softmax minus one-hot, computed per block. Same math as `F.cross_entropy(..., reduction=
"sum", ignore_index=-100)` up to float rounding (tests/test_token_loss.py).

Written here because the libraries that fuse this (Liger's fused cross-entropy) are
Triton kernels for GPUs; pitstop keeps `F.cross_entropy` on a GPU.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
_BLOCK_BYTES = (
    1 << 22
)  # fp32 bytes of one block of rows (128 rows of an 8k vocabulary): stays in cache


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """[B*T] targets for [B*T] logits: position t predicts labels[t+1]; each row's last
    position predicts nothing (IGNORE_INDEX). Shifting the labels, not the logits, keeps
    the logits a view: slicing them ([:, :-1]) copied [B, T-1, V] and zero-filled a
    full-size gradient for the slice's backward."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).flatten()


def token_ce_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropies of `logits` [N, V] at `targets` [N] (IGNORE_INDEX skipped),
    an fp32 scalar: chunked on a CPU, `F.cross_entropy` in fp32 elsewhere."""
    if logits.device.type == "cpu":
        return chunked_token_ce(logits, targets)
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_token_ce(
    logits: torch.Tensor, targets: torch.Tensor, block_rows: int | None = None
) -> torch.Tensor:
    """`token_ce_sum` a block of rows at a time (see the module docstring)."""
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"logits [N, V] and targets [N], got {logits.shape} and {targets.shape}")
    rows = block_rows or max(1, _BLOCK_BYTES // (4 * logits.shape[1]))
    return _ChunkedCE.apply(logits, targets, rows)


class _ChunkedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, rows: int) -> torch.Tensor:
        n = logits.shape[0]
        valid = targets != IGNORE_INDEX
        safe = torch.where(valid, targets, 0)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        for s in range(0, n, rows):
            lse[s : s + rows] = torch.logsumexp(logits[s : s + rows].float(), dim=-1)
        picked = logits.gather(1, safe[:, None]).squeeze(1).float()
        ctx.save_for_backward(logits, safe, valid, lse)
        ctx.rows = rows
        return torch.where(valid, lse - picked, 0.0).sum()

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        logits, safe, valid, lse = ctx.saved_tensors
        rows = ctx.rows
        grad = torch.empty_like(logits)
        scale = valid.to(torch.float32) * grad_out.to(torch.float32)  # [N]: 0 where ignored
        in_place = logits.dtype == torch.float32  # else the block is computed in fp32, then cast
        for s in range(0, logits.shape[0], rows):
            e = min(s + rows, logits.shape[0])
            # softmax of the block: fp32 logits straight into the gradient's block (no copy)
            p = grad[s:e] if in_place else torch.empty(e - s, logits.shape[1], device=grad.device)
            torch.sub(logits[s:e], lse[s:e, None], out=p).exp_()
            p[torch.arange(e - s, device=p.device), safe[s:e]] -= 1.0
            p.mul_(scale[s:e, None])
            if not in_place:
                grad[s:e] = p
        return grad, None, None
