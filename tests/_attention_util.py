"""A packed micro-batch of several rows, per-document logits, and a reference flash kernel.

Shared by the CPU attention tests and the GPU ones (not a test module).

The micro-batch is what the loader emits (batching/collate.py): three rows of 32 positions
holding seven documents, rows 0 and 2 ending in padding, row 1 full. Each document's logits
inside it are compared with the document run alone, at positions 0..n-1.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from test_batching_support import make_store

from pitstop.batching.collate import collate
from pitstop.batching.plan import MicroBatchSpec

VOCAB = 128
WIDTH = 32
LENS = [9, 14, 6, 20, 12, 5, 17]
ROWS = ([0, 1, 2], [3, 4], [5, 6])  # 29 + 3 padding, 32 + 0, 22 + 10
PAD_ID = 2


def tiny_llama(attn: str, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    """A 2-layer, 64-wide Llama with grouped-query attention (4 heads, 2 key/value heads)."""
    from transformers import AutoModelForCausalLM

    from pitstop.tiny import llama_config

    torch.manual_seed(seed)
    cfg = llama_config(VOCAB, layers=2, hidden=64, heads=4, kv_heads=2)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).to(dtype)
    model.train()
    return model


def packed_batch(
    tmp: Path,
) -> tuple[dict[str, Any], list[dict[str, Any]], list[tuple[int, int, int]]]:
    """(the packed micro-batch, each document alone, (row, first column, length) per document)."""
    store = make_store(tmp / "store", LENS, max_seq_len=WIDTH, vocab=VOCAB)
    spec = MicroBatchSpec(tuple(np.array(r) for r in ROWS), WIDTH)
    packed = collate(store.tokens, store.mask, store.offsets, spec, PAD_ID)
    alone = [
        collate(
            store.tokens, store.mask, store.offsets, MicroBatchSpec((np.array([i]),), n), PAD_ID
        )
        for i, n in enumerate(LENS)
    ]
    spans = []
    for b, row in enumerate(ROWS):
        col = 0
        for i in row:
            spans.append((b, col, LENS[i]))
            col += LENS[i]
    return packed, alone, spans


def per_doc_logits(logits: torch.Tensor, spans: list[tuple[int, int, int]]) -> list[torch.Tensor]:
    """Each document's logits [n, V] cut out of a packed [B, T, V] output."""
    return [logits[b, c : c + n] for b, c, n in spans]


def alone_logits(
    model: Any, alone: list[dict[str, Any]], device: str = "cpu"
) -> list[torch.Tensor]:
    return [
        model(
            input_ids=a["input_ids"].to(device),
            position_ids=a["position_ids"].to(device),
            use_cache=False,
        ).logits[0]
        for a in alone
    ]


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: Any
) -> torch.Tensor:
    """Attention of one sequence in flash-attn's layout: q [T, H, D], k/v [T, H_kv, D] -> [T, H, D]."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=causal, scale=scale
    )
    return out.transpose(0, 1)


def ref_flash_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """`flash_attn_varlen_func`'s contract in plain torch: q/k/v [total, H, D], one causal
    attention per cu_seqlens segment."""
    assert torch.equal(cu_seqlens_q, cu_seqlens_k) and cu_seqlens_q.dtype == torch.int32
    cu = cu_seqlens_q.tolist()
    assert max_seqlen_q == max(b - a for a, b in itertools.pairwise(cu))
    return torch.cat(
        [_attend(q[a:b], k[a:b], v[a:b], causal, softmax_scale) for a, b in itertools.pairwise(cu)]
    )


def ref_flash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """`flash_attn_func`'s contract in plain torch: q/k/v [B, T, H, D], causal over each row."""
    return torch.stack([_attend(q[i], k[i], v[i], causal, softmax_scale) for i in range(len(q))])


def install_reference_flash(monkeypatch: Any) -> None:
    """Make transformers' own flash_attention_2 path (mask handling, varlen dispatch) run on
    the CPU with the reference kernels above in place of the flash_attn package."""
    import transformers.modeling_flash_attention_utils as fau

    if not hasattr(fau, "_loaded_implementation"):
        # The harness replaces private names of transformers 5's flash path; older
        # releases lay it out differently (the GPU self-test checks the real kernel there).
        import pytest
        import transformers

        pytest.skip(
            f"the reference flash harness needs transformers >= 5 (found {transformers.__version__})"
        )
    for name, value in {
        "_loaded_implementation": "flash_attention_2",
        "_flash_fn": ref_flash,
        "_flash_varlen_fn": ref_flash_varlen,
        "_flash_with_kvcache_fn": None,
        "_pad_fn": fau._pad_input,
        "_unpad_fn": fau._unpad_input,
        "_process_flash_kwargs_fn": fau._lazy_define_process_function(ref_flash_varlen),
        "_process_with_kvcache_kwargs_fn": dict,
    }.items():
        monkeypatch.setattr(fau, name, value, raising=True)
