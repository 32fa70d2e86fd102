"""`sdpa_docs` as one opaque op for torch.compile: ``torch.ops.pitstop.sdpa_docs``.

The per-document math (train/doc_kernel.py) reads each micro-batch's document boundaries
on the host and makes one SDPA call per document: traced by dynamo, that is a graph break
in every layer, and the rest of the graph specialised to the layout (a recompile for each
new one). As a registered custom op it is one node of the graph: the boundaries are a
tensor argument (its length, the number of documents, a dynamic dimension), a fake
implementation gives the output's shape without reading them, and the op runs the same
math eagerly inside the compiled graph. Norms, rotary embeddings, the MLP and the loss
around it compile and fuse; a new layout is not a new graph.

The backward is a second opaque op (``pitstop::sdpa_docs_backward``):

- on a CPU the forward keeps each query's log-sum-exp (aten's fused CPU attention,
  ``_scaled_dot_product_flash_attention_for_cpu``, the kernel SDPA itself dispatches to
  there) and the backward calls that kernel's backward per document (or window block) with
  it: the same kernels as the eager path's autograd, nothing recomputed;
- elsewhere (a GPU: flash, memory-efficient or cuDNN kernels chosen by SDPA, grouped
  calls, the masked launch-cap path) it recomputes each document's forward under
  `torch.func.vjp` and takes its gradient: one extra attention forward per layer, with
  exactly the math of the eager path.

Autocast is applied before the op (query, key and value cast to the autocast dtype, as
SDPA's autocast rule does) and is off inside it, so the forward and the backward's
recompute run the same dtypes whatever the caller's autocast state is when the backward
runs. Attention dropout (rare in LLM training; every family pitstop tests has none) keeps
the eager path: a recompute would draw another mask.
"""

from __future__ import annotations

import torch

from pitstop.train.doc_kernel import BAND_BLOCK, MAX_CALLS, doc_spans, per_document_sdpa

__all__ = ["compiled_sdpa_docs", "sdpa_docs_op"]

_CPU_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def compiled_sdpa_docs(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float | None = None,
    window: int | None = None,
    group: bool | None = None,
    max_calls: int = MAX_CALLS,
) -> torch.Tensor:
    """`per_document_sdpa` (no dropout) through the op: what `sdpa_docs` calls while
    torch.compile traces it. query [B, H, T, D], key/value [B, H_kv, T, D] -> [B*T, H, D]."""
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        # SDPA is on autocast's lower-precision list: all three in the autocast dtype.
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    if group is None:
        group = device_type == "cuda"
    out, _ = sdpa_docs_op(query, key, value, cu_seqlens, scale, window, group, max_calls)
    return out


def _saves_lse(query: torch.Tensor, group: bool) -> bool:
    """Whether the op keeps the log-sum-exp for its backward (a CPU's one call per
    document), rather than recomputing the forward there."""
    return query.device.type == "cpu" and not group


@torch.library.custom_op("pitstop::sdpa_docs", mutates_args=())
def sdpa_docs_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None,
    window: int | None,
    group: bool,
    max_calls: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B*T, H, D], log-sum-exp [H, B*T] fp32 where `_saves_lse`, else empty)."""
    B, H, T, _ = query.shape
    with torch.autocast(query.device.type, enabled=False):
        if not _saves_lse(query, group):
            out = per_document_sdpa(
                query,
                key,
                value,
                cu_seqlens,
                scale=scale,
                window=window,
                group=group,
                max_calls=max_calls,
            )
            return out.contiguous(), query.new_empty((0,), dtype=torch.float32)
        spans = doc_spans(cu_seqlens, B, T, window)
        if spans is None:  # one document per row: one call over the rows
            o, lse = _cpu_forward(query, key, value, window, scale)
            return _flat(o), lse.transpose(0, 1).reshape(H, B * T).contiguous()
        outs, lses = [], []
        for qd, kd, vd in _documents(spans, query, key, value):
            o, lse = _cpu_forward(qd, kd, vd, window, scale)
            outs.append(o[0].transpose(0, 1))  # [L, H, D]
            lses.append(lse[0])  # [H, L]
        return torch.cat(outs), torch.cat(lses, dim=1)


@sdpa_docs_op.register_fake
def _(query, key, value, cu_seqlens, scale, window, group, max_calls):
    B, H, T, D = query.shape
    lse = (H, B * T) if _saves_lse(query, group) else (0,)
    return query.new_empty((B * T, H, D)), query.new_empty(lse, dtype=torch.float32)


@torch.library.custom_op("pitstop::sdpa_docs_backward", mutates_args=())
def sdpa_docs_backward(
    grad: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None,
    window: int | None,
    group: bool,
    max_calls: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d query, d key, d value), contiguous, of `sdpa_docs_op`'s output gradient `grad`."""
    B, H, T, _ = query.shape
    with torch.autocast(query.device.type, enabled=False):
        if not _saves_lse(query, group):

            def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                return per_document_sdpa(
                    q,
                    k,
                    v,
                    cu_seqlens,
                    scale=scale,
                    window=window,
                    group=group,
                    max_calls=max_calls,
                )

            _, vjp = torch.func.vjp(forward, query, key, value)
            return tuple(g.contiguous() for g in vjp(grad.contiguous()))  # type: ignore[return-value]
        spans = doc_spans(cu_seqlens, B, T, window)
        if spans is None:
            rows = (_rows(grad, B, T), query, key, value, _rows(out, B, T))
            dq, dk, dv = _cpu_backward(*rows, lse.view(H, B, T).transpose(0, 1), window, scale)
            return dq.contiguous(), dk.contiguous(), dv.contiguous()
        sizes = [b - a for a, b in spans]
        grads: list[list[torch.Tensor]] = [[], [], []]
        docs = zip(
            _documents(spans, query, key, value),
            grad.split(sizes),
            out.split(sizes),
            lse.split(sizes, dim=1),
            strict=True,
        )
        for (qd, kd, vd), gd, od, ld in docs:
            as_doc = (gd.transpose(0, 1)[None], qd, kd, vd, od.transpose(0, 1)[None])
            for acc, g in zip(grads, _cpu_backward(*as_doc, ld[None], window, scale)):
                acc.append(g[0].transpose(0, 1))  # [L, heads, D]
        return tuple(_unflat(torch.cat(g), B, T) for g in grads)  # type: ignore[return-value]


@sdpa_docs_backward.register_fake
def _(grad, query, key, value, out, lse, cu_seqlens, scale, window, group, max_calls):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def _setup_context(ctx, inputs, output) -> None:
    query, key, value, cu_seqlens, *args = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, out, lse, cu_seqlens)
    ctx.args = args


def _backward(ctx, grad, _grad_lse):
    query, key, value, out, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = sdpa_docs_backward(grad, query, key, value, out, lse, cu_seqlens, *ctx.args)
    return dq, dk, dv, None, None, None, None, None


sdpa_docs_op.register_autograd(_backward, setup_context=_setup_context)


# --- the CPU path: aten's fused CPU attention and its backward, with the log-sum-exp ---------


def _documents(
    spans: list[tuple[int, int]], query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each document's query, key and value as [1, heads, L, D] views of the rows."""
    B, _, T, D = query.shape
    sizes = [b - a for a, b in spans]
    flat = [
        t.transpose(1, 2).reshape(B * T, t.shape[1], D).split(sizes) for t in (query, key, value)
    ]
    return [
        (q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
        for q, k, v in zip(*flat, strict=True)
    ]


def _flat(o: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] -> [B*T, H, D] (a copy: contiguous)."""
    B, H, T, D = o.shape
    return o.transpose(1, 2).reshape(B * T, H, D).contiguous()


def _rows(flat: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """[B*T, H, D] -> [B, H, T, D] (a view)."""
    return flat.view(B, T, *flat.shape[1:]).transpose(1, 2)


def _unflat(flat: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """[B*T, heads, D] -> a contiguous [B, heads, T, D]."""
    return _rows(flat, B, T).contiguous()


def _blocks(L: int, window: int) -> list[tuple[int, int, int]]:
    """(query start, query end, first key) of each banded call over a sequence of L longer
    than its window: blocks of queries over the keys their window reaches, as
    doc_kernel._causal makes them."""
    block = max(window, BAND_BLOCK)
    return [(s, min(L, s + block), max(0, s - window + 1)) for s in range(0, L, block)]


def _band_bias(s: int, e: int, ks: int, window: int, like: torch.Tensor) -> torch.Tensor:
    """The window block's additive mask, as SDPA turns its boolean mask into one (0 where
    query s + i may see key ks + j, -inf elsewhere), in the query dtype."""
    qi = torch.arange(s, e)[:, None]
    kj = torch.arange(ks, e)[None, :]
    allowed = (kj <= qi) & (kj > qi - window)
    zero = torch.zeros((), dtype=like.dtype)
    return torch.where(allowed, zero, torch.tensor(float("-inf"), dtype=like.dtype))


def _cpu_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [b, h, L, D], log-sum-exp [b, h, L] fp32) of causal attention within `window`."""
    L = q.shape[2]
    if window is None or window >= L:  # every key a query may see is within its window
        return _CPU_FWD(q, k, v, 0.0, True, scale=scale)
    outs, lses = [], []
    for s, e, ks in _blocks(L, window):
        bias = _band_bias(s, e, ks, window, q)
        qs, kk, vv = q[:, :, s:e], k[:, :, ks:e], v[:, :, ks:e]
        o, lse = _CPU_FWD(qs, kk, vv, 0.0, False, attn_mask=bias, scale=scale)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _cpu_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    window: int | None,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of `_cpu_forward`; a window block's key gradients summed where blocks
    share keys."""
    L = q.shape[2]
    if window is None or window >= L:
        return _CPU_BWD(grad, q, k, v, out, lse, 0.0, True, scale=scale)
    dqs = []
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for s, e, ks in _blocks(L, window):
        bias = _band_bias(s, e, ks, window, q)
        dq_b, dk_b, dv_b = _CPU_BWD(
            grad[:, :, s:e],
            q[:, :, s:e],
            k[:, :, ks:e],
            v[:, :, ks:e],
            out[:, :, s:e],
            lse[:, :, s:e],
            0.0,
            False,
            attn_mask=bias,
            scale=scale,
        )
        dqs.append(dq_b)
        dk[:, :, ks:e] += dk_b
        dv[:, :, ks:e] += dv_b
    return torch.cat(dqs, dim=2), dk, dv
