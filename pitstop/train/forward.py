"""The training forward of one micro-batch: the tensors on the device with the kwargs its
attention kernel needs, the model call, and the token cross-entropy sum.

One path for the trainer, the start-up checks (train/packcheck.py, the CUDA sizer) and the
benchmarks, so what they measure is what the run computes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Required, TypedDict

import torch

from pitstop.batching.records import MicroBatch
from pitstop.probe import Choice
from pitstop.train.attention import FORWARD_KEYS, attention_kwargs
from pitstop.train.token_loss import shifted_targets, token_ce_sum


def autocast_for(precision: str) -> torch.dtype | None:
    """The autocast dtype of a run's precision choice (bf16, fp16); None for fp32."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)


class DeviceBatch(TypedDict, total=False):
    """A micro-batch on the run's device, as `to_device` makes it: the three tensors and
    the kwargs its attention kernel needs (train/attention.py FORWARD_KEYS; none for sdpa
    and eager, which read the documents' boundaries from `position_ids`)."""

    input_ids: Required[torch.Tensor]
    labels: Required[torch.Tensor]
    position_ids: Required[torch.Tensor]
    cu_seq_lens_q: torch.Tensor
    cu_seq_lens_k: torch.Tensor
    max_length_q: int
    max_length_k: int
    attention_mask: torch.Tensor  # sdpa_docs' empty marker (attention.boundaries_only_mask)


def to_device(mb: MicroBatch, device: torch.device, attention: str) -> DeviceBatch:
    """What the forward reads, on `device`: the tensors, and the kwargs `attention` needs
    to keep packed documents apart (train/attention.py)."""
    nb = device.type == "cuda"  # pinned host batches copy asynchronously
    batch = DeviceBatch(
        input_ids=mb["input_ids"].to(device, non_blocking=nb),
        labels=mb["labels"].to(device, non_blocking=nb),
        position_ids=mb["position_ids"].to(device, non_blocking=nb),
    )
    batch.update(attention_kwargs(mb, attention, device))  # type: ignore[typeddict-item]
    return batch


def forward_kwargs(batch: DeviceBatch) -> dict[str, Any]:
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
    batch: DeviceBatch,
    device_type: str,
    autocast_dtype: torch.dtype | None,
) -> torch.Tensor:
    """Sum of token cross-entropies over the targets of a micro-batch (fp32 scalar).

    `forward(**kwargs)` is the model call (the trainer's may fall back from compile).
    """
    kwargs = forward_kwargs(batch)
    with torch.autocast(
        device_type,
        dtype=autocast_dtype or torch.float32,
        enabled=autocast_dtype is not None,
    ):
        out = forward(**kwargs)
    # [B*T, V] logits and [B*T] targets (the model convention: position t predicts
    # labels[t+1]); the sum in fp32, without an fp32 copy of the logits on a CPU.
    return token_ce_sum(out.logits.flatten(0, 1), shifted_targets(batch["labels"]))


def loss_choice(device_type: str, world_size: int) -> Choice:
    """The banner's and summary's account of how `token_loss_sum` makes one step's loss."""
    how = [
        "computed by pitstop from the logits in fp32, summed over targets and divided by the "
        "step's target count (all ranks), so accumulated micro-batches give exactly one big "
        "batch's gradient"
    ]
    if device_type == "cpu":
        how.append("on a CPU a block of rows at a time, without an fp32 copy of the logits")
    if world_size > 1:
        how.append(f"x{world_size} to undo the gradient averaging across ranks")
    return Choice("fp32 token CE / step_targets", "; ".join(how))


class TimedMicroBatch:
    """One forward+backward of a micro-batch for `batching: auto`'s timing (gradients are
    thrown away). `attention` and `device_type` say what kernel it runs, and where: with
    per-document attention, `batching: auto` decides pack vs bucket from a cost model
    instead of timing them (batching.auto, which still times sdpa_docs on a GPU: launches
    per document are not positions)."""

    def __init__(
        self, model: Any, device: torch.device, attention: str, autocast_dtype: torch.dtype | None
    ) -> None:
        self.model, self.device, self.attention = model, device, attention
        self.device_type, self.autocast_dtype = device.type, autocast_dtype

    def __call__(self, mb: MicroBatch) -> float:
        batch = to_device(mb, self.device, self.attention)
        loss = token_loss_sum(self.model, batch, self.device_type, self.autocast_dtype)
        loss.backward()
        self.model.zero_grad(set_to_none=True)
        return float(loss.item())  # the sync makes the timing cover the device work
