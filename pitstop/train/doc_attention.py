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

import functools
import itertools
from collections import defaultdict
from typing import Any

import torch
import torch.nn.functional as F

from pitstop.core.errors import short_repr
from pitstop.train.attention import doc_boundaries, is_boundaries_only

DOC_ATTENTION = "sdpa_docs"

# Above this many SDPA calls per layer, a GPU micro-batch runs one call per row under a
# dense document mask: a launch costs the host ~5-10 us forward and again in backward,
# and 8 rows x 4096 tokens of ~100-token documents would be ~330 of them per layer.
MAX_CALLS = 32
# Queries per call on a document longer than its window: each block sees the window's
# keys before it as well, so a block of Q queries computes Q x (Q + W - 1) scores.
BAND_BLOCK = 256

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
    out = per_document_sdpa(
        query, key, value, cu, scale=scaling, dropout_p=dropout_p, window=sliding_window
    )
    return out.view(B, T, H, D), None


def native_gqa(
    device_type: str,
    dtype: torch.dtype,
    capability: tuple[int, int] | None,
    *,
    masked: bool = False,
) -> bool:
    """Whether SDPA's own grouped-query path (``enable_gqa``) runs a fused kernel here.

    On CUDA only the flash kernel takes it: fp16/bf16, sm80+, and no mask (a banded or
    document mask rules flash out, and the memory-efficient kernel does not group heads).
    Anywhere else there SDPA falls back to its math kernel, which materialises every
    [B, H, T, T] score; the keys and values are repeated per head instead, as transformers'
    eager path does. The CPU's fused kernel takes grouped heads in every dtype."""
    if device_type != "cuda":
        return True
    half = dtype in (torch.float16, torch.bfloat16)
    return half and not masked and capability is not None and capability >= (8, 0)


def per_document_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
    window: int | None = None,
    group: bool | None = None,
    max_calls: int = MAX_CALLS,
) -> torch.Tensor:
    """Causal attention of each document alone, each query seeing at most `window` keys
    (itself included; None: no window). query [B, H, T, D], key/value [B, H_kv, T, D],
    `cu_seqlens` int [n_docs + 1] offsets into the flattened B*T positions (covering them
    all) -> [B*T, H, D].

    `group`: documents of equal length share a call, and more than `max_calls` calls
    become one masked call per row (default: on CUDA, see the module docstring)."""
    B, H, T, D = query.shape
    h_kv = key.shape[1]
    if window is not None and window < 1:
        raise ValueError(f"sliding_window must be at least 1, got {window}")
    bounds = cu_seqlens.tolist()  # host ints: a CPU tensor costs nothing, a GPU one one sync
    if not bounds or bounds[0] != 0 or bounds[-1] != B * T:
        raise ValueError(
            f"cu_seq_lens_q must run from 0 to B*T = {B * T} (the flattened positions), "
            f"got {bounds[:1]}..{bounds[-1:]}"
        )
    spans = [(a, b) for a, b in itertools.pairwise(bounds) if b > a]
    if len(spans) == B and all(b - a == T for a, b in spans):
        # One document per row (bucket, pad): one call over the rows as they are.
        o = _causal(query, key, value, window, scale=scale, dropout_p=dropout_p)
        return o.transpose(1, 2).reshape(B * T, H, D)
    if group is None:
        group = query.device.type == "cuda"
    sizes = [b - a for a, b in spans]
    if group and _calls(sizes, window) > max_calls:
        return _masked_rows(query, key, value, spans, window, scale, dropout_p)
    # [B*T, heads, D]: documents are contiguous spans of the flattened rows.
    q = query.transpose(1, 2).reshape(B * T, H, D)
    k = key.transpose(1, 2).reshape(B * T, h_kv, D)
    v = value.transpose(1, 2).reshape(B * T, h_kv, D)
    if group:
        return _grouped(q, k, v, sizes, window, scale, dropout_p)
    # Each document is a contiguous span of the flattened rows: its q/k/v are views (no
    # gather), and the outputs, in document order, tile [B*T] exactly.
    # [1, heads, L, D]: SDPA's fused CPU kernel takes 4-d inputs only (3-d ones fall back
    # to the slower math path).
    # torch.split, not slicing: a slice's backward writes its gradient into a zeroed
    # full-size tensor (one [B*T, heads, D] fill per document and input), split's is one cat.
    outs = [
        _causal(
            qd.transpose(0, 1)[None],
            kd.transpose(0, 1)[None],
            vd.transpose(0, 1)[None],
            window,
            scale=scale,
            dropout_p=dropout_p,
        )[0].transpose(0, 1)  # [L, H, D]
        for qd, kd, vd in zip(q.split(sizes), k.split(sizes), v.split(sizes), strict=True)
    ]
    return torch.cat(outs)


def _capability(t: torch.Tensor) -> tuple[int, int] | None:
    if t.device.type != "cuda":
        return None
    return _cuda_capability(t.device.index or 0)


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    """Asked once per device: `_sdpa` consults it on every call of every layer."""
    return torch.cuda.get_device_capability(index)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    scale: float | None,
    dropout_p: float,
) -> torch.Tensor:
    """One SDPA call, causal without `mask`; grouped key/value heads passed as a fused
    kernel takes them here (`native_gqa`), else repeated per head."""
    h, h_kv = q.shape[1], k.shape[1]
    gqa = h_kv != h
    if gqa and not native_gqa(q.device.type, q.dtype, _capability(q), masked=mask is not None):
        from transformers.integrations.sdpa_attention import repeat_kv  # eager's own repeat

        k, v = repeat_kv(k, h // h_kv), repeat_kv(v, h // h_kv)
        gqa = False
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        dropout_p=dropout_p,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=gqa,
    )


def _causal(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int | None,
    *,
    scale: float | None,
    dropout_p: float,
) -> torch.Tensor:
    """Causal attention of [b, h, L, D] sequences, within `window` when they are longer."""
    L = q.shape[2]
    if window is None or window >= L:  # every key a query may see is within its window
        return _sdpa(q, k, v, None, scale=scale, dropout_p=dropout_p)
    # Blocks of queries, each over the keys its window reaches: memory and work grow with
    # L x (block + window), not L^2.
    block = max(window, BAND_BLOCK)
    outs = []
    for s in range(0, L, block):
        e = min(L, s + block)
        ks = max(0, s - window + 1)
        mask = _band(s, e, ks, window, q.device)
        outs.append(
            _sdpa(
                q[:, :, s:e], k[:, :, ks:e], v[:, :, ks:e], mask, scale=scale, dropout_p=dropout_p
            )
        )
    return torch.cat(outs, dim=2)


def _band(s: int, e: int, ks: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[e - s, e - ks] bool: query s + i may see key ks + j (causal, within the window)."""
    qi = torch.arange(s, e, device=device)[:, None]
    kj = torch.arange(ks, e, device=device)[None, :]
    allowed = kj <= qi
    if window is not None:
        allowed &= kj > qi - window
    return allowed


def _calls(sizes: list[int], window: int | None) -> int:
    """SDPA calls the grouped path makes: one per distinct length, more for long ones."""
    block = max(window or 0, BAND_BLOCK)
    return sum(1 if window is None or n <= window else -(-n // block) for n in set(sizes))


def _grouped(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sizes: list[int],
    window: int | None,
    scale: float | None,
    dropout_p: float,
) -> torch.Tensor:
    """Documents of equal length stacked into one call each; outputs back in order."""
    by_len: dict[int, list[int]] = defaultdict(list)
    for i, n in enumerate(sizes):
        by_len[n].append(i)
    qs, ks_, vs = q.split(sizes), k.split(sizes), v.split(sizes)
    outs: list[torch.Tensor | None] = [None] * len(sizes)
    for idx in by_len.values():
        # [n_docs, heads, L, D]
        qd = torch.stack([qs[i] for i in idx]).transpose(1, 2)
        kd = torch.stack([ks_[i] for i in idx]).transpose(1, 2)
        vd = torch.stack([vs[i] for i in idx]).transpose(1, 2)
        o = _causal(qd, kd, vd, window, scale=scale, dropout_p=dropout_p)
        for j, i in enumerate(idx):
            outs[i] = o[j].transpose(0, 1)  # [L, H, D]
    return torch.cat(outs)  # type: ignore[arg-type]


def _masked_rows(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    spans: list[tuple[int, int]],
    window: int | None,
    scale: float | None,
    dropout_p: float,
) -> torch.Tensor:
    """One call over all rows under a dense [B, 1, T, T] document (and window) mask: the
    launch cap's path, for micro-batches of many short documents."""
    B, H, T, D = query.shape
    doc = torch.empty(B * T, dtype=torch.int64)
    for i, (a, b) in enumerate(spans):
        doc[a:b] = i
    doc = doc.view(B, T).to(query.device, non_blocking=True)
    pos = torch.arange(T, device=query.device)
    allowed = (doc[:, :, None] == doc[:, None, :]) & (pos[None, :] <= pos[:, None])[None]
    if window is not None:
        allowed &= (pos[None, :] > pos[:, None] - window)[None]
    o = _sdpa(query, key, value, allowed[:, None], scale=scale, dropout_p=dropout_p)
    return o.transpose(1, 2).reshape(B * T, H, D)
