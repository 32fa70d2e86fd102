"""Per-document attention for packed rows where no varlen kernel exists (CPU; GPU without
flash-attn): the attention kernel `sdpa_docs`.

SDPA with a block-diagonal document mask computes all T x T scores of a packed row and
throws most away, and a dense mask also rules out SDPA's fused causal kernels. `sdpa_docs`
instead runs causal SDPA over each document's own span: a row of documents n_1..n_k costs
sum(n_i^2), as flash-attn's varlen path does on a GPU. Each document's query, key and value
are views of the row (no copy); a micro-batch of one document per row (bucket, pad: one
document plus padding continuing its positions) is one SDPA call over the rows.

The boundaries come from the varlen kwargs pitstop already builds for flash-attn
(train/attention.py: ``cu_seq_lens_q``, int32 offsets into the flattened [B*T] tokens).
Without them (a forward that is not pitstop's training forward), the documents are read
from the position restarts as transformers does; with a padding mask, or when decoding
with a cache, the kernel is transformers' own SDPA with its mask, so the model stays
correct anywhere it is called.

Registered with transformers' ``AttentionInterface`` (and its mask interface, which builds
a mask only for a caller's padding mask), so it is selected by name like the built-in
kernels: ``from_pretrained(..., attn_implementation="sdpa_docs")``.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F

from pitstop.train.attention import doc_boundaries

DOC_ATTENTION = "sdpa_docs"


def register() -> None:
    """Make `sdpa_docs` a transformers attention implementation (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(DOC_ATTENTION, doc_sdpa_attention)
    AttentionMaskInterface.register(DOC_ATTENTION, padding_only_mask)


def padding_only_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """The mask transformers builds for `sdpa_docs`: none unless the caller passed a padding
    mask. Documents are kept apart by their boundaries, not a mask, and building the dense
    [B, 1, T, T] mask costs tens of milliseconds per forward at T = 1024 on a CPU."""
    if kwargs.get("attention_mask") is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def doc_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [B, H, T, D], key/value
    [B, H_kv, T, D] -> ([B, T, H, D], no weights). Causal attention within each document
    given by ``cu_seq_lens_q``; transformers' SDPA where that is absent."""
    cu = kwargs.get("cu_seq_lens_q")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    same_length = query.shape[2] == key.shape[2]  # not decoding with a cache
    pos = kwargs.get("position_ids")
    if cu is None and attention_mask is None and causal and same_length and pos is not None:
        # A forward that is not pitstop's (no boundaries given): the documents from the
        # position restarts, transformers' own packing rule.
        cu = doc_boundaries(pos.expand(query.shape[0], -1))[0]
    if cu is None or not causal or not same_length:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
            is_causal=is_causal, **kwargs,
        )  # fmt: skip
    B, H, T, D = query.shape
    dropout_p = dropout if module.training else 0.0
    out = per_document_sdpa(query, key, value, cu, scale=scaling, dropout_p=dropout_p)
    return out.view(B, T, H, D), None


def per_document_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Causal attention of each document alone. query [B, H, T, D], key/value [B, H_kv, T, D],
    `cu_seqlens` int [n_docs + 1] offsets into the flattened B*T positions (covering them
    all) -> [B*T, H, D]."""
    B, H, T, D = query.shape
    h_kv = key.shape[1]
    # [B*T, heads, D]: documents are contiguous spans of the flattened rows.
    q = query.transpose(1, 2).reshape(B * T, H, D)
    k = key.transpose(1, 2).reshape(B * T, h_kv, D)
    v = value.transpose(1, 2).reshape(B * T, h_kv, D)
    bounds = cu_seqlens.tolist()  # host ints: a CPU tensor costs nothing, a GPU one one sync
    if not bounds or bounds[0] != 0 or bounds[-1] != B * T:
        raise ValueError(
            f"cu_seq_lens_q must run from 0 to B*T = {B * T} (the flattened positions), "
            f"got {bounds[:1]}..{bounds[-1:]}"
        )
    spans = [(a, b) for a, b in itertools.pairwise(bounds) if b > a]
    if len(spans) == B and all(b - a == T for a, b in spans):
        # One document per row (bucket, pad): one call over the rows as they are.
        o = F.scaled_dot_product_attention(
            query, key, value, dropout_p=dropout_p, is_causal=True, scale=scale,
            enable_gqa=h_kv != H,
        )  # fmt: skip
        return o.transpose(1, 2).reshape(B * T, H, D)
    # Each document is a contiguous span of the flattened rows: its q/k/v are views (no
    # gather), and the outputs, in document order, tile [B*T] exactly. An index gather of
    # equal-length documents (and its scatter-add backward) cost more on a CPU than the
    # extra SDPA calls it saved: packed documents rarely share a length.
    # [1, heads, L, D]: SDPA's fused CPU kernel takes 4-d inputs only (3-d ones fall back
    # to the slower math path).
    # torch.split, not slicing: a slice's backward writes its gradient into a zeroed
    # full-size tensor (one [B*T, heads, D] fill per document and input), split's is one cat.
    sizes = [b - a for a, b in spans]
    outs = [
        F.scaled_dot_product_attention(
            qd.transpose(0, 1)[None], kd.transpose(0, 1)[None], vd.transpose(0, 1)[None],
            dropout_p=dropout_p, is_causal=True, scale=scale, enable_gqa=h_kv != H,
        )[0].transpose(0, 1)  # [L, H, D]
        for qd, kd, vd in zip(q.split(sizes), k.split(sizes), v.split(sizes), strict=True)
    ]  # fmt: skip
    return torch.cat(outs)
