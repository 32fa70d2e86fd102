"""pitstop's per-document attention (`sdpa_docs`): a packed row's attention is computed per
document, and equals each document run alone, in logits and in gradients.

CPU, fp32, the packed micro-batch of tests/_attention_util.py (three rows, seven documents,
two rows ending in padding), for a Llama with grouped-query attention and a Qwen2 (biased
q/k/v projections). The gradients of each weight from the packed batch's loss equal the
sum over documents run alone.
"""

from __future__ import annotations

import pytest
import torch
from _attention_util import VOCAB, alone_logits, packed_batch, per_doc_logits, tiny_llama

from pitstop import probe
from pitstop.probe import DeviceInfo
from pitstop.train.doc_attention import DOC_ATTENTION, per_document_sdpa, register
from pitstop.train.forward import to_device, token_loss_sum

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")
CPU_DEV = DeviceInfo("cpu", "test cpu", cpu_count=2)
A100 = DeviceInfo("cuda", "NVIDIA A100-SXM4-80GB", (8, 0), bf16=True, total_memory_bytes=80 << 30)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return packed_batch(tmp_path_factory.mktemp("docattn"))


def tiny_qwen2(attn: str, seed: int = 0):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).train()


BUILDERS = {"llama": tiny_llama, "qwen2": tiny_qwen2}


def _no_fallback(*a, **k):
    raise AssertionError("the per-document path was not taken")


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_each_document_equals_the_document_alone_logits_and_gradients(
    data, arch, monkeypatch
) -> None:
    import transformers.integrations.sdpa_attention as hf_sdpa

    packed, alone, spans = data
    register()
    model = BUILDERS[arch](DOC_ATTENTION)
    ref_model = BUILDERS[arch]("sdpa")  # the same seed: the same weights
    batch = to_device(packed, CPU, DOC_ATTENTION)
    assert "cu_seq_lens_q" in batch  # the kernel reads the documents' boundaries
    with monkeypatch.context() as m:
        m.setattr(hf_sdpa, "sdpa_attention_forward", _no_fallback)
        loss = token_loss_sum(model, batch, "cpu", None)
    loss.backward()
    out = model(
        input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False,
        cu_seq_lens_q=batch["cu_seq_lens_q"],
    ).logits  # fmt: skip
    want = alone_logits(ref_model, alone)
    for got, ref in zip(per_doc_logits(out, spans), want):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # Gradients: the packed loss is the sum of the documents' losses (padding is no target).
    ref_loss = sum(token_loss_sum(ref_model, to_device(a, CPU, "sdpa"), "cpu", None) for a in alone)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for (name, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_documents_do_not_see_each_other_without_the_kernel(data) -> None:
    """The test has teeth: a plain causal row (what a kernel ignoring the boundaries would
    compute) differs from the documents alone."""
    packed, _, spans = data
    q = torch.randn(3, 4, 32, 8)
    k, v = torch.randn(3, 2, 32, 8), torch.randn(3, 2, 32, 8)
    cu = to_device(packed, CPU, DOC_ATTENTION)["cu_seq_lens_q"]
    docs = per_document_sdpa(q, k, v, cu).view(3, 32, 4, 8)
    rows = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True
    ).transpose(1, 2)
    second = spans[1]  # row 0's second document
    b, c, n = second
    assert (docs[b, c : c + n] - rows[b, c : c + n]).abs().max() > 1e-3
    first = spans[0]
    b, c, n = first
    torch.testing.assert_close(docs[b, c : c + n], rows[b, c : c + n])
    # One document per row (bucket, pad): one SDPA call gives plain causal rows.
    whole = torch.tensor([0, 32, 64, 96], dtype=torch.int32)
    torch.testing.assert_close(per_document_sdpa(q, k, v, whole).view(3, 32, 4, 8), rows)
    with pytest.raises(ValueError, match="from 0 to B\\*T"):
        per_document_sdpa(q, k, v, torch.tensor([0, 32], dtype=torch.int32))


def test_other_callers_get_what_transformers_sdpa_computes(data) -> None:
    """Without pitstop's boundaries: documents from the position restarts; with a padding
    mask: transformers' SDPA under that mask."""
    packed, _, _ = data
    register()
    model, ref = tiny_llama(DOC_ATTENTION), tiny_llama("sdpa")
    ids, pos = packed["input_ids"], packed["position_ids"]
    pad = torch.ones_like(ids)
    pad[0, -3:] = 0
    with torch.no_grad():
        got = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        want = ref(input_ids=ids, position_ids=pos, use_cache=False).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        got = model(input_ids=ids, attention_mask=pad, use_cache=False).logits
        want = ref(input_ids=ids, attention_mask=pad, use_cache=False).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_auto_picks_per_document_attention_where_flash_attn_cannot_run(monkeypatch) -> None:
    auto = probe.choose_attention("auto", CPU_DEV, "fp32")
    assert auto.value == DOC_ATTENTION and "sum of its documents' squared lengths" in auto.reason
    assert probe.choose_attention("sdpa", CPU_DEV, "fp32").value == "sdpa"  # still selectable
    assert probe.choose_attention("sdpa_docs", CPU_DEV, "fp32").reason.startswith("asked for")
    monkeypatch.setattr(probe, "flash_attn_status", lambda dev, prec: (False, "not installed"))
    assert probe.choose_attention("auto", A100, "bf16").value == DOC_ATTENTION
    fast = probe.choose_attention("auto", A100, "bf16", {"sdpa_docs": 30e3, "sdpa": 40e3})
    assert fast.value == "sdpa"  # a measurement on the device overrides


def test_a_run_with_auto_trains_with_it_and_its_final_model_loads_anywhere(
    tiny_model_dir, tmp_path, tiny_tokenizer
) -> None:
    import json
    import subprocess
    import sys

    from _train_util import make_store, train_config

    import pitstop.train

    store = make_store(tmp_path / "s", tiny_tokenizer)
    out = tmp_path / "out"
    s = pitstop.train.run(train_config(tiny_model_dir, store, out, max_steps=2))
    assert s["choices"]["attention"]["value"] == DOC_ATTENTION
    saved = json.loads((out / "final" / "config.json").read_text())
    assert saved.get("_attn_implementation") in (None, "sdpa")
    # A fresh process without pitstop's registration loads and runs the final model.
    code = (
        "import sys, torch; from transformers import AutoModelForCausalLM as M; "
        "m = M.from_pretrained(sys.argv[1]); m(input_ids=torch.tensor([[1, 2, 3]]))"
    )
    subprocess.run([sys.executable, "-c", code, str(out / "final")], check=True, timeout=120)
