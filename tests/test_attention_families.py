"""The kernel `pitstop train` chooses computes each model family's own attention, or is
refused with the reason (issue 35).

For each family a tiny model is saved from its config and loaded the way `pitstop train`
loads it (`model_io.load_model` with the CPU's `auto` choice, then the start-up self-check
`build.packed_attention_check`, which may switch kernel). Its packed micro-batch (three
rows, seven documents of 5-20 tokens, padding) must give, in fp32, the logits and the
gradients of the model's eager attention run on each document alone. The windowed
families have a window of 4 tokens, so every document is longer than its window; Gemma 3
has one sliding and one full layer; Gemma 2 has a logit softcap, which sdpa_docs does not
compute and refuses.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from _attention_util import VOCAB, alone_logits, packed_batch, per_doc_logits

from pitstop import probe
from pitstop.probe import DeviceInfo
from pitstop.train import attention_rows, doc_attention, model_io, packcheck
from pitstop.train.attention_check import packed_attention_check
from pitstop.train.forward import to_device, token_loss_sum

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")
CPU_DEV = DeviceInfo("cpu", "test cpu", cpu_count=2)
WINDOW = 4
_SMALL = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "mistral-window": ("mistral", {"sliding_window": WINDOW}),
    "phi3-window": ("phi3", {"sliding_window": WINDOW}),
    "gemma3-sliding-and-full": (
        "gemma3_text",
        {
            "sliding_window": WINDOW,
            "head_dim": 16,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    "gemma2-softcap": (
        "gemma2",
        {
            "sliding_window": WINDOW,
            "head_dim": 16,
            "attn_logit_softcapping": 50.0,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return packed_batch(tmp_path_factory.mktemp("families"))


def save_family(family: str, root: Path, **over: Any) -> Path:
    """A tiny model of `family` saved as a model directory (safetensors)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, extra = FAMILIES[family]
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **{**_SMALL, **extra, **over})
    out = root / family
    AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").save_pretrained(out)
    return out


def load_as_train_does(model_dir: Path, attention: str = "auto") -> tuple[Any, str, str]:
    """(model, the kernel the run trains with, why) as `pitstop train` decides on a CPU."""
    cfg = SimpleNamespace(
        model=str(model_dir),
        trust_remote_code=False,
        lora_r=None,
        load_in_4bit=False,
        gradient_checkpointing=False,
        attention=attention,
    )
    choice = probe.choose_attention(attention, CPU_DEV, "fp32")
    model, chosen, _ = model_io.load_model(cfg, CPU_DEV, "fp32", choice)
    check, fallback = packed_attention_check(model, CPU, chosen.value, None, "fp32")
    chosen = fallback or chosen
    assert check.ok, check.summary()
    return model, chosen.value, chosen.reason


def eager_model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").train()


@pytest.mark.parametrize("rows", [False, True], ids=["per-document", "row-products"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_chosen_kernel_computes_the_models_own_attention(
    family, rows, data, tmp_path, monkeypatch
) -> None:
    """Both ways sdpa_docs computes on a CPU (train/attention_rows.py): a call per document,
    or each row as matrix products under its documents' mask."""
    packed, alone, spans = data
    model_dir = save_family(family, tmp_path)
    model, kernel, why = load_as_train_does(model_dir)
    calls = []
    real = doc_attention.row_matmul_attention
    monkeypatch.setattr(
        doc_attention, "row_matmul_attention", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    attention_rows.apply_rows(model, rows)
    if family == "gemma2-softcap":
        # sdpa_docs (and sdpa) cannot apply a logit softcap: refused, with the reason.
        assert kernel == "eager", (kernel, why)
        assert "sdpa_docs" in why
    else:
        assert kernel == doc_attention.DOC_ATTENTION, (kernel, why)
    ref = eager_model(model_dir)
    batch = to_device(packed, CPU, kernel)
    loss = token_loss_sum(model, batch, "cpu", None)
    loss.backward()
    with torch.no_grad():
        out = model(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            use_cache=False,
            **{k: v for k, v in batch.items() if k.startswith(("cu_seq", "max_length"))},
        ).logits
        want = alone_logits(ref, alone)
    for i, (got, exp) in enumerate(zip(per_doc_logits(out, spans), want, strict=True)):
        torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-5, msg=f"document {i}")
    ref_loss = sum(token_loss_sum(ref, to_device(a, CPU, "eager"), "cpu", None) for a in alone)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert bool(calls) == (rows and kernel == doc_attention.DOC_ATTENTION)


def test_long_documents_in_blocks_of_queries(monkeypatch, data) -> None:
    """A document much longer than its window runs in blocks of queries, each over the keys
    its window reaches: the same output and gradients as one banded call."""
    q = torch.randn(1, 4, 40, 8, requires_grad=True)
    k = torch.randn(1, 2, 40, 8, requires_grad=True)
    v = torch.randn(1, 2, 40, 8, requires_grad=True)
    cu = torch.tensor([0, 3, 40], dtype=torch.int32)
    whole = doc_attention.per_document_sdpa(q, k, v, cu, window=5)
    g_whole = torch.autograd.grad(whole.square().sum(), (q, k, v))
    monkeypatch.setattr(doc_attention, "BAND_BLOCK", 1)  # blocks of 5 queries
    blocks = doc_attention.per_document_sdpa(q, k, v, cu, window=5)
    torch.testing.assert_close(blocks, whole)
    for a, b in zip(torch.autograd.grad(blocks.square().sum(), (q, k, v)), g_whole, strict=True):
        torch.testing.assert_close(a, b)
    # The window is real: the last query of the long document differs from plain causal.
    causal = doc_attention.per_document_sdpa(q, k, v, cu)
    assert (causal[-1] - whole[-1]).abs().max() > 1e-3


@pytest.mark.parametrize("window", [None, 3])
def test_grouped_and_capped_paths_equal_one_call_per_document(window, monkeypatch) -> None:
    """The GPU's launch plan (documents of equal length share a call; past the cap, one
    masked call for all rows) computes what one call per document computes, on the CPU;
    and it makes the number of calls it promises."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 24, 8, requires_grad=True)
    k = torch.randn(2, 2, 24, 8, requires_grad=True)
    v = torch.randn(2, 2, 24, 8, requires_grad=True)
    cu = torch.tensor([0, 6, 12, 24, 30, 36, 48], dtype=torch.int32)  # lengths 6,6,12,6,6,12
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def counting(*a: Any, **kw: Any) -> torch.Tensor:
        calls.append(a[0].shape)
        return real(*a, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    each = doc_attention.per_document_sdpa(q, k, v, cu, window=window, group=False)
    assert len(calls) == 6
    grads = torch.autograd.grad(each.sum(), (q, k, v))
    calls.clear()
    grouped = doc_attention.per_document_sdpa(q, k, v, cu, window=window, group=True)
    assert len(calls) == 2  # one call per distinct length
    torch.testing.assert_close(grouped, each)
    for a, b in zip(torch.autograd.grad(grouped.sum(), (q, k, v)), grads, strict=True):
        torch.testing.assert_close(a, b)
    calls.clear()
    capped = doc_attention.per_document_sdpa(q, k, v, cu, window=window, group=True, max_calls=1)
    assert len(calls) == 1  # one masked call over both rows
    torch.testing.assert_close(capped, each)
    for a, b in zip(torch.autograd.grad(capped.sum(), (q, k, v)), grads, strict=True):
        torch.testing.assert_close(a, b)


def test_grouped_query_heads_repeated_where_sdpa_would_take_its_math_kernel(monkeypatch) -> None:
    """On CUDA, SDPA's enable_gqa runs fused only in fp16/bf16 on sm80+; anywhere else the
    keys and values are repeated per head (as eager does) instead."""
    assert doc_attention.native_gqa("cpu", torch.float32, None)
    assert doc_attention.native_gqa("cuda", torch.bfloat16, (8, 0))
    assert not doc_attention.native_gqa("cuda", torch.float32, (9, 0))  # fp32 / TF32
    assert not doc_attention.native_gqa("cuda", torch.float16, (7, 5))  # T4
    assert not doc_attention.native_gqa("cuda", torch.float16, (7, 0))  # V100
    # A mask (a window's band, the launch cap's document mask) rules flash out.
    assert not doc_attention.native_gqa("cuda", torch.bfloat16, (9, 0), masked=True)
    # Repeated heads compute what SDPA's grouped path computes, on every path.
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 24, 8), torch.randn(2, 2, 24, 8), torch.randn(2, 2, 24, 8)
    cu = torch.tensor([0, 6, 12, 24, 30, 36, 48], dtype=torch.int32)
    paths = [{"window": None}, {"window": 3}, {"group": True}, {"group": True, "max_calls": 1}]
    native = [doc_attention.per_document_sdpa(q, k, v, cu, **kw) for kw in paths]
    monkeypatch.setattr(doc_attention, "native_gqa", lambda *a, **kw: False)
    for kw, want in zip(paths, native, strict=True):
        got = doc_attention.per_document_sdpa(q, k, v, cu, **kw)
        torch.testing.assert_close(got, want, msg=str(kw))


def test_what_the_kernel_cannot_compute_it_refuses_by_name() -> None:
    assert (
        doc_attention.unmatched({"position_ids": 1, "sliding_window": None, "softcap": None})
        is None
    )
    assert doc_attention.unmatched({"use_cache": False, "output_router_logits": True}) is None
    assert "softcap" in doc_attention.unmatched({"softcap": 30.0})
    assert "sinks" in doc_attention.unmatched({"s_aux": torch.zeros(4)})
    assert "made_up" in doc_attention.unmatched({"made_up": 1.0})


def test_a_kernel_that_ignores_the_window_fails_the_self_check(tmp_path, monkeypatch) -> None:
    """The self-check compares with eager, on documents longer than the window, in every
    layer: a kernel dropping the window is refused, by the numbers. A real-sized window
    (4096) is shrunk for the check, then restored."""
    doc_attention.register()
    model_dir = save_family("gemma3-sliding-and-full", tmp_path, sliding_window=4096)
    model, kernel, _ = load_as_train_does(model_dir)
    check, _ = packed_attention_check(model, CPU, kernel, None, "fp32")
    assert check.ok and "shrunk to 5" in check.summary()
    assert packcheck.model_windows(model) == [4096]  # restored
    # One short window beside the long one: the long one's layers are checked all the same.
    attn0 = model.model.layers[0].self_attn
    attn0.sliding_window = 4
    check, _ = packed_attention_check(model, CPU, kernel, None, "fp32")
    assert check.ok and "4, 4096 shrunk to 5" in check.summary(), check.summary()
    assert packcheck.model_windows(model) == [4, 4096]
    attn0.sliding_window = 4096
    real = doc_attention.doc_sdpa_attention

    def windowless(*a: Any, sliding_window: Any = None, **kw: Any) -> Any:
        return real(*a, **kw)

    monkeypatch.setattr(doc_attention, "doc_sdpa_attention", windowless)
    doc_attention.register()
    try:
        check, fallback = packed_attention_check(model, CPU, kernel, None, "fp32")
    finally:
        monkeypatch.undo()
        doc_attention.register()
    assert fallback is None and not check.ok
    assert check.calibrated and check.worst > check.tolerance > check.noise
    msg = str(packcheck.leak_error(check, batching="pack", attention_choices=["sdpa"]))
    assert "DIFFER" in msg and f"{check.worst:.1e}" in msg and "planted leak" in msg


def test_a_kernel_that_refuses_falls_back_to_one_that_computes_it(tmp_path) -> None:
    """Gemma 2's softcap reaching sdpa_docs (transformers 5 refuses it at load; 4.56 loads
    it): the first forward raises KernelMismatch, and the run takes eager, not sdpa (which
    cannot apply a softcap either, and in transformers 4.56 drops it silently), with the
    reason in the banner's choice."""
    doc_attention.register()
    model = eager_model(save_family("gemma2-softcap", tmp_path))
    model.config._attn_implementation = doc_attention.DOC_ATTENTION
    check, fallback = packed_attention_check(model, CPU, doc_attention.DOC_ATTENTION, None, "fp32")
    assert check.ok and fallback is not None and fallback.value == "eager"
    assert "logit softcap" in fallback.reason and "eager instead" in fallback.reason


def test_other_callers_keep_the_window(tmp_path) -> None:
    """Calls that are not pitstop's training forward (no boundaries: documents from the
    position restarts; a padding mask; decoding with a cache past the window) give what
    eager gives, window included."""
    doc_attention.register()
    model_dir = save_family("mistral-window", tmp_path)
    from transformers import AutoModelForCausalLM

    docs = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa_docs").eval()
    ref = eager_model(model_dir).eval()
    torch.manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 12))
    pos = torch.tensor([list(range(5)) + list(range(7)), list(range(12))])
    pad = torch.ones_like(ids)
    pad[1, :2] = 0  # left padding
    with torch.no_grad():
        for kw in ({"position_ids": pos}, {"attention_mask": pad}):
            got = docs(input_ids=ids, use_cache=False, **kw).logits
            want = ref(input_ids=ids, use_cache=False, **kw).logits
            real = pad.bool() if "attention_mask" in kw else slice(None)  # padding: no query
            torch.testing.assert_close(
                got[real], want[real], rtol=1e-5, atol=1e-5, msg=str(list(kw))
            )
        gen = {"max_new_tokens": 8, "do_sample": False, "output_logits": True}
        gen |= {"return_dict_in_generate": True, "pad_token_id": 0}
        got = docs.generate(ids[:1, :3], **gen)
        want = ref.generate(ids[:1, :3], **gen)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
