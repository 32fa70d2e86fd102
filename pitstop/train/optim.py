"""AdamW with the usual parameter groups: no weight decay on 1-D parameters.

Norm weights, biases (and any other vector) are 1-D; decaying them toward zero
hurts training and is not what weight decay is for (Loshchilov & Hutter regularise
weight matrices). Embedding and projection matrices are 2-D and are decayed.

`--optimizer adamw_8bit` / `paged_adamw_8bit` use bitsandbytes' block-wise 8-bit
AdamW (Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization"): the
same update rule with both moments stored in 8 bits (plus one fp32 scale per block),
about 2 bytes per trainable parameter instead of 8. The update differs from fp32
AdamW only by that quantisation; tensors under 4096 values keep fp32 moments.
"""

from __future__ import annotations

from typing import Any

import torch

from pitstop.core.config import parse_betas
from pitstop.core.errors import MissingDependencyError
from pitstop.probe import Choice, DeviceInfo, choose_optimizer

__all__ = ["build_optimizer", "choose", "param_groups", "parse_betas"]

EIGHT_BIT = {"adamw_8bit": "AdamW8bit", "paged_adamw_8bit": "PagedAdamW8bit"}


def bitsandbytes_problem() -> str | None:
    """Why bitsandbytes cannot be used here, or None."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        return "bitsandbytes is not installed: pip install 'bitsandbytes>=0.45'"
    except Exception as e:  # a broken native library raises RuntimeError and kin at import
        return f"bitsandbytes does not load here ({type(e).__name__}: {e})"
    return None


def choose(cfg: Any, dev: DeviceInfo) -> Choice:
    """The optimizer the run uses and why: --optimizer, else fused/foreach AdamW by device."""
    if cfg.optimizer == "adamw":
        return choose_optimizer(dev)
    problem = bitsandbytes_problem()
    if problem:
        raise MissingDependencyError(f"--optimizer {cfg.optimizer} needs bitsandbytes; {problem}")
    paged = (
        "paged: moments can spill to host memory under pressure; "
        if "paged" in cfg.optimizer
        else ""
    )
    return Choice(
        cfg.optimizer,
        f"--optimizer {cfg.optimizer}: bitsandbytes 8-bit AdamW ({paged}~2 B of moments per "
        "trainable parameter instead of 8)",
    )


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
    model: torch.nn.Module,
    *,
    lr: float,
    weight_decay: float,
    choice: Choice,
    betas: tuple[float, float] = (0.9, 0.95),
) -> torch.optim.Optimizer:
    """AdamW, fused on CUDA (one kernel, supports sync-free skipping) and on the CPU (one
    pass over each parameter), foreach elsewhere; or bitsandbytes' 8-bit AdamW when
    `choice` says so."""
    groups = param_groups(model, weight_decay)
    if choice.value in EIGHT_BIT:
        import bitsandbytes as bnb

        cls = getattr(bnb.optim, EIGHT_BIT[choice.value])
        return cls(groups, lr=lr, betas=betas, eps=1e-8)
    fused = choice.value == "adamw_fused"
    kwargs: dict[str, Any] = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8, **kwargs)
