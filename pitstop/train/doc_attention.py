"""Per-document attention for packed rows where no varlen kernel exists (CPU; GPU without
flash-attn): the attention kernel `sdpa_docs`.

SDPA with a block-diagonal document mask computes all T x T scores of a packed row and
throws most away, and a dense mask also rules out SDPA's fused causal kernels. `sdpa_docs`
instead runs causal SDPA over each document's own span: a row of documents n_1..n_k costs
sum(n_i^2), as flash-attn's varlen path does on a GPU. Each document's query, key and value
are views of the row (no copy); a micro-batch of one document per row (bucket, pad: one
document plus padding continuing its positions) is one SDPA call over the rows.

It computes exactly the model's own attention, or refuses:

- a sliding window (Mistral, Phi-3, Gemma 2/3's local layers, Qwen2 with windows): the
  layer passes ``sliding_window`` W and a query sees itself and the W - 1 keys before it,
  as transformers' ``sliding_window_overlay`` and flash-attn's ``window_size=(W-1, W-1)``
  do. A document no longer than W is unaffected (plain causal); a longer one runs in
  blocks of queries, each over only the keys its window can reach, under a banded mask.
- anything else a layer passes that changes the attention (Gemma 2's logit ``softcap``,
  GPT-OSS's attention sinks ``s_aux``, a keyword this module does not know, bidirectional
  attention) raises `KernelMismatch` naming it. The start-up self-check
  (train/packcheck.py) runs the model's first forward, so a run that would have trained a
  different attention instead switches kernel, and the banner says why.

On a GPU, where each SDPA call is a kernel launch the host must issue (forward and
backward), documents of equal length share one call, and a micro-batch whose documents
would need more than `MAX_CALLS` calls runs one call per row under a dense document mask
instead: full rows of short documents would otherwise make the step host-bound. On a CPU
the gather that grouping needs costs more than the calls it saves (bench/step_kernels.py),
so each document is its own call there.

The boundaries come from the varlen kwargs pitstop already builds for flash-attn
(train/attention.py: ``cu_seq_lens_q``, int32 offsets into the flattened [B*T] tokens).
Without them (a forward that is not pitstop's training forward), the documents are read
from the position restarts as transformers does (whole rows without positions); with a
padding mask, or when decoding with a cache, the kernel is transformers' own SDPA with
the mask transformers built (window included), so the model stays correct anywhere it is
called.

Registered with transformers' ``AttentionInterface`` (and its mask interface, which builds
a mask only for a caller's padding mask or a cache), so it is selected by name like the
built-in kernels: ``from_pretrained(..., attn_implementation="sdpa_docs")``. Written by
hand: no library computes per-document windowed attention with SDPA's fused kernels.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from pitstop.core.errors import short_repr
from pitstop.train.attention import doc_boundaries, is_boundaries_only
from pitstop.train.doc_kernel import (
    BAND_BLOCK,
    MAX_CALLS,
    native_gqa,
    per_document_sdpa,
    row_matmul_attention,
)
from pitstop.train.doc_op import compiled_sdpa_docs

# The math lives in train/doc_kernel.py; its names stay importable from here.
__all__ = [
    "BAND_BLOCK",
    "DOC_ATTENTION",
    "MAX_CALLS",
    "ROWS_ATTR",
    "KernelMismatch",
    "doc_sdpa_attention",
    "native_gqa",
    "per_document_sdpa",
    "register",
    "through_op",
]

DOC_ATTENTION = "sdpa_docs"
# Set on a model's modules (train/attention_rows.py: apply_rows) where each row computes as
# matrix products under its documents' mask: measured faster on this CPU at this shape.
ROWS_ATTR = "pitstop_attention_rows"

# Keyword arguments transformers' attention layers pass that do not change what attention
# computes (the boundaries are read separately; flags about caching and outputs).
_NEUTRAL = frozenset(
    {
        "position_ids",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "use_cache",
        "output_attentions",
        "output_router_logits",
        "output_hidden_states",
        "cache_position",
        "past_key_values",
        "cache",
        "layer_idx",
        "return_dict",
    }
)


# Set by `through_op`: eager calls take the compiled path (the op) too.
_through_op = False


@contextlib.contextmanager
def through_op() -> Iterator[None]:
    """Within it, `sdpa_docs` computes through the op a compiled graph calls
    (train/doc_op.py) even when nothing is compiling: the start-up check (train/packcheck.py)
    checks that path too, without compiling the model."""
    global _through_op
    before, _through_op = _through_op, True
    try:
        yield
    finally:
        _through_op = before


class KernelMismatch(ValueError):
    """`sdpa_docs` was asked for an attention it does not compute (a logit softcap,
    attention sinks, ...): using it would train a different attention than the model's."""


def register() -> None:
    """Make `sdpa_docs` a transformers attention implementation (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(DOC_ATTENTION, doc_sdpa_attention)
    AttentionMaskInterface.register(DOC_ATTENTION, padding_only_mask)


def padding_only_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """The mask transformers builds for `sdpa_docs` when a caller other than pitstop's
    training forward (which passes `attention.boundaries_only_mask` and so skips mask
    building) calls the model: none without a padding mask or a cache (documents and
    windows are the kernel's), else transformers' own SDPA mask (a caller's padding mask,
    or decoding with a cache, windows included). Building the dense [B, 1, T, T] mask costs
    tens of milliseconds per forward at T = 1024 on a CPU."""
    q_len, kv_len = kwargs.get("q_length"), kwargs.get("kv_length")
    decoding = q_len != kv_len or bool(kwargs.get("q_offset") or kwargs.get("kv_offset"))
    if kwargs.get("attention_mask") is None and not decoding:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def unmatched(kwargs: dict[str, Any]) -> str | None:
    """What in a layer's attention keyword arguments `sdpa_docs` cannot compute (None: all)."""
    for key, value in kwargs.items():
        if key in _NEUTRAL or value is None:
            continue
        if key == "softcap":
            return f"a logit softcap ({value}: the scores pass through tanh)"
        if key in ("s_aux", "sinks"):
            return "attention sinks (a learned logit per head in every softmax)"
        shown = (
            f"<tensor {tuple(value.shape)}>" if torch.is_tensor(value) else short_repr(value, 40)
        )
        return f"the keyword {key}={shown} (not known to change nothing)"
    return None


def doc_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [B, H, T, D], key/value
    [B, H_kv, T, D] -> ([B, T, H, D], no weights). Causal attention within each document
    given by ``cu_seq_lens_q``, within the layer's ``sliding_window``; transformers' SDPA
    with its mask for a padding mask or a cache. Raises `KernelMismatch` for an attention
    it does not compute."""
    problem = unmatched(kwargs)
    if problem:
        raise KernelMismatch(
            f"{DOC_ATTENTION} cannot compute {type(module).__name__}'s attention: it passes "
            f"{problem}"
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    B, H, T, D = query.shape
    if is_boundaries_only(attention_mask):  # pitstop's training forward: no mask was built
        attention_mask = None
    if attention_mask is not None or key.shape[2] != T:
        # transformers built the mask (a caller's padding, or decoding with a cache): its
        # own SDPA applies it, windows included (padding_only_mask).
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    if not causal:
        raise KernelMismatch(
            f"{DOC_ATTENTION} cannot compute {type(module).__name__}'s attention: it is "
            "bidirectional, and sdpa_docs is causal"
        )
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        # A forward that is not pitstop's (no boundaries given): the documents from the
        # position restarts, transformers' own packing rule; whole rows without positions.
        pos = kwargs.get("position_ids")
        if pos is not None:
            cu = doc_boundaries(pos.expand(B, -1))[0]
        else:
            cu = torch.arange(0, B * T + 1, T, dtype=torch.int32)
    dropout_p = dropout if module.training else 0.0
    if (_through_op or torch.compiler.is_compiling()) and not dropout_p:
        # One opaque node for torch.compile: no graph break, no recompile per layout
        # (train/doc_op.py). Eager runs keep the plain autograd of the same math.
        out = compiled_sdpa_docs(query, key, value, cu, scale=scaling, window=sliding_window)
    elif getattr(module, ROWS_ATTR, False):
        # Each row as two matrix products: measured faster on this CPU at this shape
        # (train/attention_rows.py).
        out = row_matmul_attention(
            query, key, value, cu, scale=scaling, dropout_p=dropout_p, window=sliding_window
        )
    else:
        out = per_document_sdpa(
            query, key, value, cu, scale=scaling, dropout_p=dropout_p, window=sliding_window
        )
    return out.view(B, T, H, D), None
