"""On a GPU, in bf16: packed micro-batches of several rows keep documents apart on every
attention backend that runs there, forward and backward (`pytest -m gpu`).

The CPU half of these checks (fp32; flex forward only, since FlexAttention has no CPU
backward; flash through a reference kernel) is test_attention_packed.py. Here the real
kernels run: sdpa, eager, flex_attention, and flash_attention_2 when flash-attn is
installed. Tolerances are bf16's (8-bit mantissa): a leak between documents moves the
logits of this tiny model by ~1, far beyond them (the flash test checks that too).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _attention_util import alone_logits, packed_batch, per_doc_logits, tiny_llama

from pitstop import probe
from pitstop.train.attention import VARLEN_KEYS
from pitstop.train.forward import to_device, token_loss_sum

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA device: torch sees none (run `pytest -m gpu` on a GPU machine)",
    ),
]

CUDA = torch.device("cuda")
BF16 = {"rtol": 2e-2, "atol": 2e-2}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return packed_batch(tmp_path_factory.mktemp("attn_gpu"))


def runnable_or_skip(attn: str) -> None:
    dev, _ = probe.detect_device("cuda")
    if attn == "flash_attention_2":
        ok, why = probe.flash_attn_status(dev, "bf16")
    elif attn == "flex_attention":
        ok, why = probe.flex_attention_status(dev)
    else:
        ok, why = True, ""
    if not ok:
        pytest.skip(f"{attn} cannot run here: {why}")


def forward(model, batch: dict, **extra) -> torch.Tensor:
    """The logits of a packed batch the way the trainer calls the model: bf16 autocast."""
    kw = {k: batch[k] for k in VARLEN_KEYS if k in batch}
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False,
            **kw, **extra,
        ).logits.float()  # fmt: skip


@pytest.mark.parametrize("attn", ["sdpa", "eager", "flex_attention", "flash_attention_2"])
def test_packed_rows_match_documents_alone_in_bf16(attn, data) -> None:
    runnable_or_skip(attn)
    packed, alone, spans = data
    model = tiny_llama(attn).to(CUDA)  # fp32 master weights, bf16 autocast: as the trainer
    batch = to_device(packed, CUDA, attn)
    with torch.no_grad():
        out = forward(model, batch)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ref = [r.float() for r in alone_logits(model, alone, "cuda")]
    for i, (got, want) in enumerate(zip(per_doc_logits(out, spans), ref)):
        torch.testing.assert_close(got, want, **BF16, msg=lambda m, i=i: f"document {i}: {m}")
    if attn == "flash_attention_2":
        # Without the varlen kwargs flash-attn runs each whole row causally (B > 1):
        # the test would see the leak.
        bare = {k: batch[k] for k in ("input_ids", "position_ids")}
        with torch.no_grad():
            leaky = forward(model, bare)
        diffs = [(g - w).abs().max().item() for g, w in zip(per_doc_logits(leaky, spans), ref)]
        later = [d for (_, c, _), d in zip(spans, diffs) if c > 0]
        assert min(later) > 0.1, diffs


@pytest.mark.parametrize("attn", ["flex_attention", "flash_attention_2", "eager"])
def test_packed_gradients_match_sdpa_in_bf16(attn, data) -> None:
    runnable_or_skip(attn)
    packed, _, _ = data
    grads = {}
    for name in ("sdpa", attn):
        model = tiny_llama(name).to(CUDA)  # the same seed: the same weights
        loss = token_loss_sum(model, to_device(packed, CUDA, name), "cuda", torch.bfloat16)
        loss.backward()
        grads[name] = (loss.detach(), {k: p.grad for k, p in model.named_parameters()})
    (ref_loss, ref), (loss, got) = grads["sdpa"], grads[attn]
    torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=1e-2)
    for k, g in got.items():
        rel = ((g - ref[k]).norm() / ref[k].norm().clamp_min(1e-12)).item()
        assert rel < 5e-2, f"{k}: gradient differs from sdpa's by {rel:.3f} of its norm"


@pytest.mark.parametrize("attn", ["flex_attention", "flash_attention_2"])
def test_a_short_run_trains_like_sdpa(attn, tiny_model_dir, tiny_tokenizer, tmp_path) -> None:
    """`pitstop train --attention X` end to end on the GPU: X is the kernel the run used,
    and its per-step losses follow sdpa's (bf16)."""
    runnable_or_skip(attn)
    from _train_util import make_store, train_config

    import pitstop.train

    store = make_store(tmp_path / "store", tiny_tokenizer)
    losses = {}
    for name in ("sdpa", attn):
        out = tmp_path / name
        cfg = train_config(tiny_model_dir, store, out, attention=name, device="cuda", seed=7)
        summary = pitstop.train.run(cfg)
        assert summary["choices"]["attention"]["value"] == name
        lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
        losses[name] = [json.loads(x)["loss"] for x in lines]
    assert losses[attn] == pytest.approx(losses["sdpa"], rel=2e-2)
