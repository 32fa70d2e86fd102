"""The per-document attention math of `sdpa_docs` (train/doc_attention.py is its
transformers interface, train/doc_op.py the same math as one opaque op for torch.compile).

`per_document_sdpa` runs causal SDPA over each document's own span of a packed micro-batch,
within a sliding window where the layer has one; `doc_spans` reads and checks the
documents' boundaries (host ints). On a GPU documents of equal length share a call and a
micro-batch needing more than `MAX_CALLS` calls runs one masked call per row (the launch
cap); on a CPU each document is its own call (the gather costs more there).
"""

from __future__ import annotations

import functools
import itertools
from collections import defaultdict

import torch
import torch.nn.functional as F

__all__ = [
    "BAND_BLOCK",
    "MAX_CALLS",
    "doc_spans",
    "native_gqa",
    "per_document_sdpa",
    "row_matmul_attention",
]

# Above this many SDPA calls per layer, a GPU micro-batch runs one call per row under a
# dense document mask: a launch costs the host ~5-10 us forward and again in backward,
# and 8 rows x 4096 tokens of ~100-token documents would be ~330 of them per layer.
MAX_CALLS = 32
# Queries per call on a document longer than its window: each block sees the window's
# keys before it as well, so a block of Q queries computes Q x (Q + W - 1) scores.
BAND_BLOCK = 256


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
    spans = doc_spans(cu_seqlens, B, T, window)
    if spans is None:
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


def doc_spans(
    cu_seqlens: torch.Tensor, rows: int, width: int, window: int | None = None
) -> list[tuple[int, int]] | None:
    """The documents' (start, end) in the flattened rows x width positions, from the
    offsets (host ints); None when each row is one whole document (bucket, pad). Raises
    ValueError for offsets that do not cover the positions, or a window below 1."""
    if window is not None and window < 1:
        raise ValueError(f"sliding_window must be at least 1, got {window}")
    bounds = cu_seqlens.tolist()  # host ints: a CPU tensor costs nothing, a GPU one one sync
    if not bounds or bounds[0] != 0 or bounds[-1] != rows * width:
        raise ValueError(
            f"cu_seq_lens_q must run from 0 to B*T = {rows * width} (the flattened positions), "
            f"got {bounds[:1]}..{bounds[-1:]}"
        )
    spans = [(a, b) for a, b in itertools.pairwise(bounds) if b > a]
    if len(spans) == rows and all(b - a == width for a, b in spans):
        return None
    return spans


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
    allowed = _document_mask(spans, B, T, window, query.device)
    o = _sdpa(query, key, value, allowed[:, None], scale=scale, dropout_p=dropout_p)
    return o.transpose(1, 2).reshape(B * T, H, D)


def _document_mask(
    spans: list[tuple[int, int]] | None, B: int, T: int, window: int | None, device: torch.device
) -> torch.Tensor:
    """[B, T, T] bool: query i of a row may see key j (the same document, causal, within the
    window). `spans` None: each row is one document."""
    pos = torch.arange(T, device=device)
    allowed = (pos[None, :] <= pos[:, None])[None]
    if window is not None:
        allowed = allowed & (pos[None, :] > pos[:, None] - window)[None]
    if spans is None:
        return allowed.expand(B, T, T)
    doc = torch.empty(B * T, dtype=torch.int64)
    for i, (a, b) in enumerate(spans):
        doc[a:b] = i
    doc = doc.view(B, T).to(device, non_blocking=True)
    return (doc[:, :, None] == doc[:, None, :]) & allowed


def row_matmul_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
    window: int | None = None,
) -> torch.Tensor:
    """`per_document_sdpa`'s attention computed a row at a time, as transformers' eager
    attention computes it: every query-key score of the row in one matrix product, the
    documents' causal (and window) mask, softmax in fp32, then one product with the values.
    Same arguments and result ([B*T, H, D]).

    It computes T x T scores a row where the per-document path computes the sum of each
    document's squared length, but as two large matrix products instead of a fused-kernel
    call per document: on a CPU in bf16 at short rows that is several times faster
    (train/attention_rows.py times it per run and shape)."""
    B, H, T, D = query.shape
    spans = doc_spans(cu_seqlens, B, T, window)
    allowed = _document_mask(spans, B, T, window, query.device)[:, None]  # [B, 1, T, T]
    h_kv = key.shape[1]
    if h_kv != H:
        key = key.repeat_interleave(H // h_kv, dim=1)  # as transformers' repeat_kv
        value = value.repeat_interleave(H // h_kv, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * (D**-0.5 if scale is None else scale)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    if dropout_p:
        probs = F.dropout(probs, p=dropout_p)
    out = torch.matmul(probs, value)  # [B, H, T, D]
    return out.transpose(1, 2).reshape(B * T, H, D)
