"""Packing never changes the math: a document inside a packed row trains exactly as alone.

A tiny fp32 Llama built from a config; for SDPA and eager attention, each document's
summed cross-entropy and the gradients it contributes are compared between the packed
row (as the loader builds it: restarting position_ids, no attention_mask) and the
document computed on its own. Two negative controls show the test has teeth:
positions that do not restart, and a plain all-ones attention mask, both let documents
see each other and change the result.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_batching_support import make_store

from pitstop.batching.collate import collate
from pitstop.batching.plan import MicroBatchSpec

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 128
LENS = [9, 14, 6]  # three documents packed into a row of 32 (3 padding positions)
WIDTH = 32


def build(attn: str):
    from transformers import AutoModelForCausalLM

    from pitstop.tiny import llama_config

    torch.manual_seed(0)
    cfg = llama_config(VOCAB, layers=2, hidden=64, heads=4)
    cfg._attn_implementation = attn
    model = AutoModelForCausalLM.from_config(cfg).float()
    model.train()  # no dropout in Llama; train mode is what the trainer runs
    return model


def ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed CE with the HF shift: position t predicts labels[t+1]. logits [B,T,V], labels [B,T]."""
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]),
        labels[:, 1:].reshape(-1),
        ignore_index=-100,
        reduction="sum",
    )


def doc_losses(model, batch, **override):
    """Per-document summed CE inside the (single) packed row, computed in one forward."""
    kw = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    kw.update(override)
    logits = model(**kw, use_cache=False).logits  # [1, T, V]
    out, col = [], 0
    for n in LENS:
        lab = torch.full_like(batch["labels"], -100)
        lab[:, col : col + n] = batch["labels"][:, col : col + n]
        out.append(ce_sum(logits, lab))
        col += n
    return out


def grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward(retain_graph=True)
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    store = make_store(tmp_path_factory.mktemp("a") / "s", LENS, max_seq_len=WIDTH, vocab=VOCAB)
    packed = collate(
        store.tokens, store.mask, store.offsets, MicroBatchSpec((np.arange(3),), WIDTH), 2
    )
    alone = [
        collate(store.tokens, store.mask, store.offsets, MicroBatchSpec((np.array([i]),), n), 2)
        for i, n in enumerate(LENS)
    ]
    return packed, alone


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_documents_match_documents_alone(attn, data):
    packed, alone = data
    model = build(attn)
    losses = doc_losses(model, packed)
    assert sum(b["labels"].ne(-100).sum() for b in alone) == packed["labels"].ne(-100).sum()
    total_alone = 0.0
    for loss, single in zip(losses, alone):
        out = model(
            input_ids=single["input_ids"], position_ids=single["position_ids"], use_cache=False
        )
        ref = ce_sum(out.logits, single["labels"])
        total_alone += ref.item()
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
        g_packed, g_alone = grads(model, loss), grads(model, ref)
        assert g_packed.keys() == g_alone.keys()
        for k in g_alone:
            torch.testing.assert_close(g_packed[k], g_alone[k], rtol=1e-5, atol=1e-5, msg=k)
    # The labels the loader emits give the same total through the HF shift.
    logits = model(
        input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False
    ).logits
    assert ce_sum(logits, packed["labels"]).item() == pytest.approx(total_alone, rel=1e-5)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_leaky_packing_is_caught(attn, data):
    packed, _ = data
    model = build(attn)
    good = torch.stack(doc_losses(model, packed))
    arange = torch.arange(WIDTH)[None]
    no_reset = torch.stack(doc_losses(model, packed, position_ids=arange))
    ones_mask = torch.stack(
        doc_losses(model, packed, attention_mask=torch.ones(1, WIDTH, dtype=torch.long))
    )
    for leaky in (no_reset, ones_mask):
        torch.testing.assert_close(
            leaky[0], good[0], rtol=1e-5, atol=1e-5
        )  # first doc: nothing before it
        assert (leaky[1:] - good[1:]).abs().min() > 1e-3  # later docs saw earlier ones
