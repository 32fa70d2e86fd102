"""The start-up packed-attention self-check (pitstop/train/packcheck.py) on the CPU.

A normal model passes on every kernel that runs here (sdpa, eager; flash_attention_2
through transformers' real flash path with a plain-torch kernel); a planted leak is
refused: transformers' packed-row detection disabled (what transformers 4.53-4.57 do
with torch < 2.6), or flash without the document boundaries. A run on a leaking kernel
stops before step 1 with the ways out; a bucket run goes on with a warning.
"""

from __future__ import annotations

import json

import pytest
import torch
from _attention_util import install_reference_flash, tiny_llama

from pitstop.train import packcheck
from pitstop.train.forward import forward_kwargs, to_device

CPU = torch.device("cpu")


def _check(model, attention: str, precision: str = "fp32", **over) -> packcheck.PackCheck:
    kw = {
        "forward_kwargs": forward_kwargs,
        "to_device": lambda mb, kernel: to_device(mb, CPU, kernel),
        "device_type": "cpu",
        "autocast_dtype": {"bf16": torch.bfloat16}.get(precision),
        "precision": precision,
        "attention": attention,
        "vocab_size": model.config.vocab_size,
    }
    kw.update(over)
    return packcheck.check_packed_attention(model, **kw)


def _disable_packed_detection(monkeypatch) -> None:
    """Plant a leak: transformers no longer sees the documents of a packed row."""
    import transformers.masking_utils as mu

    monkeypatch.setattr(mu, "find_packed_sequence_indices", lambda position_ids: None)


def test_probe_batch_is_two_full_rows_with_restarting_positions() -> None:
    packed, alone = packcheck.packed_probe(128)
    assert packed["input_ids"].shape == (2, 24)
    assert len(alone) == 5
    assert packed["position_ids"][1].tolist() == [0, 1, 2, *range(12), *range(9)]
    assert torch.equal(packed["input_ids"][1, 3:15], alone[3]["input_ids"][0])


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_normal_model_passes(attn: str) -> None:
    model = tiny_llama(attn)
    check = _check(model, attn)
    assert check.ok, check.summary()
    assert check.worst < 1e-4
    assert model.training  # the check restores train mode


def test_bf16_autocast_passes_within_its_tolerance() -> None:
    check = _check(tiny_llama("sdpa"), "sdpa", precision="bf16")
    assert check.ok, check.summary()
    # Calibrated on this model: between its bf16 rounding and a planted leak.
    assert check.calibrated
    assert check.noise < check.tolerance < check.leak


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_planted_leak_is_caught(attn: str, monkeypatch) -> None:
    _disable_packed_detection(monkeypatch)
    check = _check(tiny_llama(attn), attn)
    assert not check.ok
    # The leak is far beyond even bf16's tolerance: the check has room on both sides.
    assert check.worst > 5 * packcheck.TOLERANCE["bf16"], check.summary()
    assert "DIFFER" in check.summary()


def test_sdpa_docs_is_checked_as_a_compiled_graph_calls_it_too(monkeypatch) -> None:
    """A leak planted only in sdpa_docs' compiled path (the op: each row one causal
    sequence, the documents ignored) fails the check, though the eager path is right."""
    from pitstop.train import doc_attention, doc_kernel

    doc_attention.register()
    model = tiny_llama("sdpa_docs")
    assert _check(model, "sdpa_docs").ok

    def rows_only(q, k, v, cu, **kw):
        B, _, T, _ = q.shape
        whole_rows = torch.arange(0, B * T + 1, T, dtype=torch.int32)
        return doc_kernel.per_document_sdpa(q, k, v, whole_rows, **kw)

    monkeypatch.setattr(doc_attention, "compiled_sdpa_docs", rows_only)
    leak = _check(model, "sdpa_docs")
    assert not leak.ok, leak.summary()


def test_flash_path_passes_with_boundaries_and_leaks_without(monkeypatch) -> None:
    install_reference_flash(monkeypatch)
    model = tiny_llama("sdpa")
    model.config._attn_implementation = "flash_attention_2"  # the flash_attn package is faked
    assert _check(model, "flash_attention_2").ok
    # What pitstop passed before the varlen kwargs: position_ids only (B > 1 leaks).
    leak = _check(model, "flash_attention_2", to_device=lambda mb, k: to_device(mb, CPU, "sdpa"))
    assert not leak.ok


def test_leak_error_names_the_ways_out() -> None:
    check = packcheck.PackCheck(False, 0.4, 1e-3, 2, 0.01, "sdpa")
    err = packcheck.leak_error(check, batching="pack", attention_choices=["sdpa", "eager"])
    msg = str(err)
    assert "--attention eager" in msg and "--batching bucket" in msg and "pip install" in msg
    assert "--attention sdpa" not in msg
    assert err.exit_code == 2


@pytest.mark.slow
def test_a_run_with_a_planted_leak_is_refused_before_step_1(
    tiny_model_dir, store, tmp_path, monkeypatch
) -> None:
    from _train_util import train_config

    from pitstop.train.trainer import Trainer

    _disable_packed_detection(monkeypatch)
    out = tmp_path / "out"
    cfg = train_config(tiny_model_dir, store, out, attention="sdpa", max_steps=1, device="cpu")
    with pytest.raises(packcheck.PackedAttentionLeak, match="--batching bucket"):
        Trainer.from_config(cfg).fit()
    assert not (out / "metrics.jsonl").exists()
    # A bucket run packs nothing: it is not affected, and trains (with a warning).
    cfg = train_config(
        tiny_model_dir, store, tmp_path / "b", attention="sdpa", max_steps=1, device="cpu",
        batching="bucket",
    )  # fmt: skip
    s = Trainer.from_config(cfg).fit().to_json()
    assert s["choices"]["packed_attention"]["value"] == "leaks (unused)"


@pytest.mark.slow
def test_a_normal_run_announces_the_check(tiny_model_dir, store, tmp_path, capsys) -> None:
    from _train_util import train_config

    from pitstop.train.trainer import Trainer

    out = tmp_path / "out"
    cfg = train_config(tiny_model_dir, store, out, max_steps=1, device="cpu")
    Trainer.from_config(cfg).fit()
    choice = json.loads((out / "summary.json").read_text())["choices"]["packed_attention"]
    assert choice["value"] == "checked" and "equal" in choice["reason"]
    assert "packed_attention" in capsys.readouterr().err
