"""AdamW with the usual parameter groups: no weight decay on 1-D parameters.

Norm weights, biases (and any other vector) are 1-D; decaying them toward zero
hurts training and is not what weight decay is for (Loshchilov & Hutter regularise
weight matrices). Embedding and projection matrices are 2-D and are decayed.
"""

from __future__ import annotations

from typing import Any

import torch

from pitstop.probe import Choice


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups of trainable parameters: 2-D+ with decay, 1-D without."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(
    model: torch.nn.Module, *, lr: float, weight_decay: float, choice: Choice
) -> torch.optim.Optimizer:
    """AdamW, fused on CUDA (one kernel, supports sync-free skipping), foreach elsewhere."""
    fused = choice.value == "adamw_fused"
    kwargs: dict[str, Any] = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(
        param_groups(model, weight_decay), lr=lr, betas=(0.9, 0.95), eps=1e-8, **kwargs
    )
