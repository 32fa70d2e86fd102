"""Packed micro-batches of several rows keep documents apart on every attention backend.

CPU, fp32, a tiny Llama with grouped-query attention; the micro-batch has three rows and
seven documents (tests/_attention_util.py). What runs here:

- the varlen kwargs pitstop builds for flash_attention_2 are exactly the documents'
  boundaries, and other backends get none;
- transformers' real flash_attention_2 path, with a plain-torch kernel in place of the
  flash_attn package: with the kwargs each document's logits equal the document alone;
  without them (what pitstop passed before: position_ids only) documents of a multi-row
  micro-batch attend to each other, so the test has teeth;
- flex_attention's forward (it has no backward on the CPU): each document equals the
  document alone, and the SDPA packed forward.

The same checks in bf16 on a GPU, with gradients, are in test_attention_gpu.py (-m gpu).
"""

from __future__ import annotations

import pytest
import torch
from _attention_util import (
    LENS,
    alone_logits,
    install_reference_flash,
    packed_batch,
    per_doc_logits,
    tiny_llama,
)

from pitstop import probe
from pitstop.core.errors import ConfigError
from pitstop.probe import DeviceInfo
from pitstop.train.attention import VARLEN_KEYS, doc_boundaries
from pitstop.train.forward import to_device, token_loss_sum

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")
A100 = DeviceInfo("cuda", "NVIDIA A100-SXM4-80GB", (8, 0), bf16=True, total_memory_bytes=80 << 30)
CPU_DEV = DeviceInfo("cpu", "test cpu", cpu_count=2)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return packed_batch(tmp_path_factory.mktemp("attn"))


def test_varlen_kwargs_are_the_document_boundaries(data) -> None:
    packed, _, spans = data
    batch = to_device(packed, CPU, "flash_attention_2")
    # Row-major offsets into the flattened [3 * 32] batch; a row's right padding belongs to
    # its last document (its positions continue that document's).
    expected = [0, 9, 23, 32, 52, 64, 69, 96]
    assert [b * 32 + c for b, c, _ in spans] == expected[:-1]
    for k in ("cu_seq_lens_q", "cu_seq_lens_k"):
        assert batch[k].dtype == torch.int32 and batch[k].tolist() == expected
    assert batch["max_length_q"] == batch["max_length_k"] == 27  # 17 + 10 padding
    assert isinstance(batch["max_length_q"], int)  # an int: no device sync to read it
    # A loader without cu_seqlens gets the same boundaries derived from position_ids.
    cu, longest = doc_boundaries(packed["position_ids"])
    assert cu.tolist() == expected and longest == 27
    bare = {k: packed[k] for k in ("input_ids", "labels", "position_ids")}
    assert to_device(bare, CPU, "flash_attention_2")["cu_seq_lens_q"].tolist() == expected
    # Backends that cannot use the kwargs never receive them.
    for attn in ("sdpa", "eager", "flex_attention"):
        assert set(to_device(packed, CPU, attn)) == {"input_ids", "labels", "position_ids"}


def test_flash_varlen_path_keeps_documents_of_several_rows_apart(data, monkeypatch) -> None:
    packed, alone, spans = data
    install_reference_flash(monkeypatch)
    model = tiny_llama("sdpa")
    ref = alone_logits(model, alone)
    sdpa_loss = token_loss_sum(model, to_device(packed, CPU, "sdpa"), "cpu", None)
    model.config._attn_implementation = "flash_attention_2"  # the flash_attn package is faked
    batch = to_device(packed, CPU, "flash_attention_2")
    out = model(
        input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False,
        **{k: batch[k] for k in VARLEN_KEYS},
    ).logits  # fmt: skip
    for got, want in zip(per_doc_logits(out, spans), ref):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The forward pitstop trains with passes the kwargs: the same loss as SDPA's.
    flash_loss = token_loss_sum(model, batch, "cpu", None)
    torch.testing.assert_close(flash_loss, sdpa_loss, rtol=1e-5, atol=1e-5)
    # Without them (position_ids only), transformers runs each whole row causally for
    # B > 1: every document after the first of its row sees the ones before it.
    leaky = model(
        input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
    ).logits
    firsts = {i for i, (_, c, _) in enumerate(spans) if c == 0}
    for i, (got, want) in enumerate(zip(per_doc_logits(leaky, spans), ref)):
        if i in firsts:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            assert (got - want).abs().max() > 1e-3, f"document {i} did not see its row"


def test_flex_forward_matches_documents_alone_on_cpu(data) -> None:
    packed, alone, spans = data
    # A flex kernel compiled for another shape earlier in this process (the attention bench's
    # smoke test) would make dynamo recompile with dynamic shapes, which torch 2.13 cannot
    # build on the CPU: start from a clean slate.
    torch._dynamo.reset()
    flex = tiny_llama("flex_attention")
    sdpa = tiny_llama("sdpa")  # the same seed: the same weights
    batch = to_device(packed, CPU, "flex_attention")
    with torch.no_grad():  # FlexAttention has no backward on the CPU (torch 2.13)
        out = flex(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
        ).logits
        ref = alone_logits(sdpa, alone)
        sdpa_out = sdpa(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
        ).logits
    assert len(ref) == len(LENS)
    for got, want in zip(per_doc_logits(out, spans), ref):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for got, want in zip(per_doc_logits(out, spans), per_doc_logits(sdpa_out, spans)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_flex_attention_is_refused_where_it_cannot_train() -> None:
    no_cpu_backward = r"flex_attention is not possible: FlexAttention has no backward on the CPU"
    with pytest.raises(ConfigError, match=no_cpu_backward + r".*use sdpa or auto"):
        probe.choose_attention("flex_attention", CPU_DEV, "fp32")
    auto = probe.choose_attention("auto", CPU_DEV, "fp32")
    assert auto.value == "sdpa_docs" and "no backward on the CPU" in auto.reason
    # A timing that says flex is fastest cannot pick it where it cannot train.
    fastest = probe.choose_attention("auto", CPU_DEV, "fp32", {"flex_attention": 9e9})
    assert fastest.value == "sdpa_docs"


def test_attention_auto_on_a_gpu_without_flash_attn(monkeypatch) -> None:
    monkeypatch.setattr(probe, "flash_attn_status", lambda dev, prec: (False, "not installed"))
    asked = probe.choose_attention("flex_attention", A100, "bf16")
    assert asked.value == "flex_attention" and "block mask" in asked.reason
    auto = probe.choose_attention("auto", A100, "bf16")
    # Unmeasured, auto takes per-document SDPA (no dense mask) and says what flex would
    # change and how to measure it.
    assert auto.value == "sdpa_docs"
    assert "each document's own span" in auto.reason and "bench.attention --gpu" in auto.reason
    fast_flex = probe.choose_attention("auto", A100, "bf16", {"sdpa": 30e3, "flex_attention": 36e3})
    assert fast_flex.value == "flex_attention" and "flex_attention 36,000" in fast_flex.reason
    slow_flex = probe.choose_attention("auto", A100, "bf16", {"sdpa": 30e3, "flex_attention": 20e3})
    assert slow_flex.value == "sdpa" and "measured" in slow_flex.reason


def test_flex_attention_is_a_config_choice_and_preflight_checks_it() -> None:
    from pitstop.core.config import build_config

    cfg = build_config(
        {"model": "m", "data": ["d"], "output": "o", "attention": "flex_attention"}, None
    )
    assert cfg.attention == "flex_attention"
    problems = probe.preflight(cfg, CPU_DEV)
    assert any("--attention flex_attention is not possible" in p for p in problems)
    assert all("flex" not in p for p in probe.preflight(cfg, A100))


def test_tune_measures_flex_against_sdpa_on_a_gpu_without_flash_attn(monkeypatch) -> None:
    from pitstop.core.config import build_config
    from pitstop.tune.space import build_space

    cfg = build_config({"model": "m", "data": ["d"], "output": "o", "max_seq_len": 64}, None)
    monkeypatch.setattr(probe, "flash_attn_status", lambda dev, prec: (False, "not installed"))
    assert "flex_attention" in build_space(cfg, A100, 256).attention
    assert "flex_attention" not in build_space(cfg, CPU_DEV, 256).attention
