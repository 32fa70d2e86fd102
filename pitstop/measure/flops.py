"""Training FLOPs per token and model FLOPs utilisation (MFU).

Accounting (PaLM, Chowdhery et al. 2022, appendix B; as in nanoGPT's `estimate_mfu`):
a forward pass costs 2 FLOPs per parameter per token and the backward pass twice
that, so training costs 6·N per token, N being the non-embedding parameters (an
embedding lookup is not a matmul; the output projection is, so it counts). Attention
scores and their weighted sum add 12·L·d·T per token (L layers, d model width,
T the row length attended over: forward 4·L·d·T, backward twice that).

With frozen weights (LoRA), no weight gradient is computed for them, so their
backward costs 2 FLOPs per parameter instead of 4: 4·N_frozen + 6·N_trainable.

MFU divides the achieved model FLOP/s by the device's peak (see `peak.py`); it uses
every position computed (padding included), since that is what the device did.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FlopsModel:
    """The counts the formula needs, taken from a model once."""

    n_trainable: int  # non-embedding parameters that receive gradients
    n_frozen: int  # non-embedding parameters that do not
    n_layers: int
    d_model: int

    def per_token(self, seq_len: int) -> float:
        """Training FLOPs per token for rows of `seq_len` positions."""
        dense = 6 * self.n_trainable + 4 * self.n_frozen
        attention = 12 * self.n_layers * self.d_model * seq_len
        return float(dense + attention)


def flops_model(model: Any) -> FlopsModel:
    """Count a (HF, possibly PEFT-wrapped) causal LM's parameters for the FLOPs formula."""
    emb = model.get_input_embeddings()
    emb_ids = {id(p) for p in emb.parameters()} if emb is not None else set()
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    out_ids = {id(p) for p in out.parameters()} if out is not None else set()
    trainable = frozen = 0
    for p in model.parameters():
        if id(p) in emb_ids and id(p) not in out_ids:
            continue  # a lookup table; a tied table is also the output matmul, which counts
        if p.requires_grad:
            trainable += p.numel()
        else:
            frozen += p.numel()
    cfg = model.config
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    layers = int(getattr(text_cfg, "num_hidden_layers", 0) or getattr(text_cfg, "n_layer", 0))
    width = int(getattr(text_cfg, "hidden_size", 0) or getattr(text_cfg, "n_embd", 0))
    return FlopsModel(n_trainable=trainable, n_frozen=frozen, n_layers=layers, d_model=width)


def mfu(
    positions_per_second: float, flops_per_token: float, peak_flops: float | None
) -> float | None:
    """Achieved model FLOP/s over the device's peak; None when the peak is unknown."""
    if not peak_flops or peak_flops <= 0:
        return None
    return positions_per_second * flops_per_token / peak_flops
