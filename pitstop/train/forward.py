"""The training forward of one micro-batch: the tensors on the device with the kwargs its
attention kernel needs, the model call, and the token cross-entropy sum.

One path for the trainer, the start-up checks (train/packcheck.py, the CUDA sizer) and the
benchmarks, so what they measure is what the run computes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pitstop.train.attention import FORWARD_KEYS, attention_kwargs
from pitstop.train.token_loss import shifted_targets, token_ce_sum


def to_device(mb: dict[str, Any], device: torch.device, attention: str) -> dict[str, Any]:
    """What the forward reads, on `device`: the tensors, and the kwargs `attention` needs
    to keep packed documents apart (train/attention.py)."""
    nb = device.type == "cuda"  # pinned host batches copy asynchronously
    batch: dict[str, Any] = {
        k: mb[k].to(device, non_blocking=nb) for k in ("input_ids", "labels", "position_ids")
    }
    batch.update(attention_kwargs(mb, attention, device))
    return batch


def forward_kwargs(batch: dict[str, Any]) -> dict[str, Any]:
    """What the training forward passes to the model for a `to_device` batch."""
    # No attention_mask: the model derives a block-diagonal causal mask from position_ids
    # (documents packed in one row never attend to each other); flash-attn and sdpa_docs
    # read the documents' boundaries from the varlen kwargs instead, when to_device added
    # them (sdpa_docs also an empty marker mask: train/attention.py boundaries_only_mask).
    # train/packcheck.py checks that this holds on the run's device before step 1.
    return {
        "input_ids": batch["input_ids"],
        "position_ids": batch["position_ids"],
        "use_cache": False,
        **{k: batch[k] for k in FORWARD_KEYS if k in batch},
    }


def token_loss_sum(
    forward: Callable[..., Any],
    batch: dict[str, Any],
    device_type: str,
    autocast_dtype: torch.dtype | None,
) -> torch.Tensor:
    """Sum of token cross-entropies over the targets of a micro-batch (fp32 scalar).

    `forward(**kwargs)` is the model call (the trainer's may fall back from compile).
    """
    kwargs = forward_kwargs(batch)
    with torch.autocast(
        device_type, dtype=autocast_dtype or torch.float32,
        enabled=autocast_dtype is not None,
    ):  # fmt: skip
        out = forward(**kwargs)
    # [B*T, V] logits and [B*T] targets (the model convention: position t predicts
    # labels[t+1]); the sum in fp32, without an fp32 copy of the logits on a CPU.
    return token_ce_sum(out.logits.flatten(0, 1), shifted_targets(batch["labels"]))
