"""What a run holds in memory beyond a bare forward and backward, and the CUDA sizer that
measures a micro-batch: optimizer-state and checkpoint host bytes (the cost model's bytes
per parameter, so the estimate agrees), the bytes the sizer reserves, and the checkpoint
policy the banner states."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from pitstop.batching.microsize import SIZING_PASSES
from pitstop.batching.resolve import MicroSizer
from pitstop.core.config import RunConfig
from pitstop.core.errors import DataError
from pitstop.measure import cost_model  # the one cost model: optimizer-state bytes
from pitstop.probe import Choice
from pitstop.train import checkpoint, distributed, model_io, optim
from pitstop.train.forward import to_device, token_loss_sum


def checkpoint_host_bytes(
    model: Any, params: list[torch.nn.Parameter], optimizer: Choice
) -> tuple[int, int]:
    """(weights, optimizer state) bytes a checkpoint copies to host memory. The optimizer
    state does not exist before the first step, so it is computed from the parameters."""
    weights = checkpoint.state_bytes(model_io.trainable_state(model))
    return weights, optimizer_state_bytes(params, optimizer)


def optimizer_state_bytes(params: list[torch.nn.Parameter], optimizer: Choice) -> int:
    """Bytes of optimizer state for `params`, before the first step allocates it."""
    # The cost model's bytes per parameter (AdamW's two moments in the parameter's dtype;
    # bitsandbytes' 8-bit moments with their block scales), so the estimate agrees.
    name = "adamw_8bit" if optimizer.value in optim.EIGHT_BIT else "adamw"
    return int(
        sum(
            p.numel() * cost_model.optimizer_state_bytes_per_param(name, p.element_size())
            for p in params
        )
    )


def cuda_sizer(
    model: Any,
    device: torch.device,
    attention: str,
    autocast_dtype: torch.dtype | None,
    optimizer: Choice,
    *,
    ddp: bool = False,
    cfg: RunConfig | None = None,
    precision: str = "bf16",
) -> MicroSizer:
    """Measures a micro-batch's peak memory and time on this GPU (pitstop.batching.microsize);
    with `cfg`, also predicts it from the memory cost model (what sizing falls back to where
    measuring would not pay back on the run: pitstop.batching.payoff)."""

    def measure(mb: dict[str, Any]) -> tuple[float, float]:
        batch = to_device(mb, device, attention)  # the kernel the run trains with
        times = []
        try:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            # Two passes without zeroing: the second runs with the first's gradients alive,
            # as every micro-batch after the first of a step does. The first warms up.
            for _ in range(SIZING_PASSES):
                t0 = time.perf_counter()
                token_loss_sum(model, batch, device.type, autocast_dtype).backward()
                torch.cuda.synchronize(device)
                times.append(time.perf_counter() - t0)
            peak = float(torch.cuda.max_memory_allocated(device))
        except torch.cuda.OutOfMemoryError:
            peak = times_min = math.inf
        else:
            times_min = min(times[1:])
        finally:
            model.zero_grad(set_to_none=True)
            del batch
            torch.cuda.empty_cache()
        return peak, times_min

    free, _ = torch.cuda.mem_get_info(device)
    capacity = free + torch.cuda.memory_reserved(device)  # what this process can reach
    params = [p for p in model.parameters() if p.requires_grad]
    return MicroSizer(
        measure,
        capacity,
        sizer_reserved_bytes(params, optimizer, ddp=ddp),
        start_peak_window=lambda: torch.cuda.reset_peak_memory_stats(device),
        predict=memory_predictor(cfg, attention, precision) if cfg is not None else None,
    )


def memory_predictor(
    cfg: RunConfig, attention: str, precision: str
) -> Callable[[int], float] | None:
    """rows -> a micro-batch of that many rows' predicted peak bytes for a step (weights,
    gradients, optimizer state, activations, logits: `cost_model.estimate_memory`); None
    for a model the cost model cannot read."""
    try:
        shape = cost_model.shape_from_model_dir(cfg.model)
    except (DataError, OSError, ValueError):
        return None
    plan = cost_model.Plan(
        seq_len=cfg.max_seq_len,
        precision=precision if precision in cost_model.COMPUTE_BYTES else "bf16",
        attention=attention,
        gradient_checkpointing=cfg.gradient_checkpointing,
        lora_r=cfg.lora_r,
        load_in_4bit=cfg.load_in_4bit,
        optimizer=cfg.optimizer,
    )

    def predict(rows: int) -> float:
        return float(cost_model.peak_at(shape, plan, rows))

    return predict


def sizer_reserved_bytes(
    params: list[torch.nn.Parameter],
    optimizer: Choice,
    *,
    ddp: bool,
    bucket_view: bool = distributed.GRADIENT_AS_BUCKET_VIEW,
) -> int:
    """Device bytes the run will hold that a one-process forward+backward of the bare model
    does not show: the optimizer's moments, and under DDP any gradient copy in its buckets."""
    extra = distributed.ddp_gradient_copy_bytes(params, bucket_view=bucket_view) if ddp else 0
    return optimizer_state_bytes(params, optimizer) + extra


def checkpoint_reason(
    model: Any,
    params: list[torch.nn.Parameter],
    optimizer: Choice,
    device: torch.device,
    fsdp: bool,
) -> str:
    writes = "a background thread writes atomically (partial dir, marker, rename)"
    if fsdp:
        return f"asynchronous: the loop pauses to gather full state to host memory; {writes}"
    weights, moments = checkpoint_host_bytes(model, params, optimizer)
    gpu = device.type == "cuda"
    where = (
        "pinned host memory, filled on a side CUDA stream (the next optimizer step waits "
        "for the copy on the device, not the host)"
        if gpu
        else "host memory"
    )
    return (
        f"asynchronous: the loop pauses only to queue a copy into {(weights + moments) / 1e9:.2f} "
        f"GB of {where}: weights {weights / 1e9:.2f} GB + optimizer state "
        f"{moments / 1e9:.2f} GB, allocated at the first checkpoint and reused; {writes}; every "
        "checkpoint, the last included, keeps the optimizer state (--resume continues exactly)"
    )


def save_policy(cfg: RunConfig) -> str:
    parts = []
    if cfg.save_steps:
        parts.append(f"every {cfg.save_steps} steps")
    if cfg.save_minutes:
        parts.append(f"every {cfg.save_minutes:g} min")
    parts.append("at the end")
    return ", ".join(parts) + f"; keep {cfg.save_total_limit}"
