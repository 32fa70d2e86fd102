"""Models in from the local Hub cache; results out in the base's dtype, adapters that load
from anywhere, and a merged LoRA export that is a plain HF model with the same logits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from _train_util import fake_hub_cache

from pitstop.core.config import build_config
from pitstop.core.errors import ConfigError


def _cfg(model, store, out, **over):
    from _train_util import train_config

    return train_config(model, store, out, **over)


def test_a_cached_hub_id_resolves_offline(tmp_path, tiny_model_dir, monkeypatch):
    snap = fake_hub_cache(tmp_path / "hub", "org/tiny", tiny_model_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    cfg = build_config({"model": "org/tiny", "data": ["x.jsonl"]}, command="prepare")
    assert Path(cfg.model) == snap.resolve()
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # HF_HOME/hub is the same cache
    cfg = build_config({"model": "org/tiny", "data": ["x.jsonl"]}, command="prepare")
    assert Path(cfg.model) == snap.resolve()
    missing = build_config({"model": "org/missing", "data": ["x.jsonl"]}, command="prepare")
    assert missing.model == "org/missing"  # left as given: opening it says what is missing
    from pitstop.data.prepare import prepare_data
    from pitstop.train.model_io import check_model_dir

    with pytest.raises(ConfigError, match=r"not in the local Hugging Face cache.*hf download"):
        prepare_data(missing, progress=False)
    with pytest.raises(ConfigError, match=r"no config.json.*hf download org/missing"):
        check_model_dir(Path("org/missing"), False)


def _safetensors_dtypes(d: Path) -> set[torch.dtype]:
    from safetensors.torch import load_file

    return {t.dtype for f in d.glob("*.safetensors") for t in load_file(f).values()}


def test_a_bf16_base_comes_out_bf16_unless_asked(tmp_path, tiny_model_dir, store):
    from transformers import AutoModelForCausalLM

    from pitstop.train import run

    bf16 = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).save_pretrained(bf16)
    for f in tiny_model_dir.glob("tokenizer*"):
        shutil.copy(f, bf16)
    run(_cfg(bf16, store, tmp_path / "a", max_steps=2))
    final = tmp_path / "a" / "final"
    assert _safetensors_dtypes(final) == {torch.bfloat16}
    assert json.loads((final / "config.json").read_text())["dtype"] == "bfloat16"
    ckpt = next((tmp_path / "a" / "checkpoints").iterdir())
    assert _safetensors_dtypes(ckpt) == {torch.float32}  # resume keeps the fp32 masters
    assert AutoModelForCausalLM.from_pretrained(final).dtype == torch.bfloat16

    run(_cfg(bf16, store, tmp_path / "b", max_steps=2, save_dtype="fp32"))
    assert _safetensors_dtypes(tmp_path / "b" / "final") == {torch.float32}


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def test_lora_adapter_names_an_absolute_base_and_merges_to_the_same_logits(
    tmp_path, tiny_model_dir, store, monkeypatch
):
    import peft
    from transformers import AutoModelForCausalLM

    from pitstop.cli import main
    from pitstop.train import run

    monkeypatch.chdir(tiny_model_dir.parent)  # --model given as a relative path
    out = tmp_path / "lora"
    run(_cfg(Path(tiny_model_dir.name), store, out, lora_r=4, max_steps=3, lr=1e-2))
    acfg = json.loads((out / "final" / "adapter_config.json").read_text())
    assert acfg["base_model_name_or_path"] == str(tiny_model_dir.resolve())

    monkeypatch.chdir(tmp_path)  # the adapter loads from elsewhere
    assert main(["export", str(out), "--merge"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(out / "merged")
    assert not any("lora" in n for n, _ in merged.named_parameters())
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.arange(1, 33).unsqueeze(0)
    plain = _logits(base, ids)
    with_adapter = _logits(peft.PeftModel.from_pretrained(base, out / "final"), ids)
    assert (with_adapter - plain).abs().max() > 1e-3  # the adapter learned something
    torch.testing.assert_close(_logits(merged, ids), with_adapter, atol=1e-4, rtol=1e-4)

    assert main(["export", str(out)]) == 2  # --merge is what export does; say so


def test_merge_lora_at_the_end_of_training_and_hub_id_base(
    tmp_path, tiny_model_dir, store, monkeypatch
):
    from transformers import AutoModelForCausalLM

    from pitstop.train import run

    fake_hub_cache(tmp_path / "hub", "org/tiny", tiny_model_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    out = tmp_path / "run"
    run(_cfg("org/tiny", store, out, lora_r=4, max_steps=2, merge_lora=True))
    acfg = json.loads((out / "final" / "adapter_config.json").read_text())
    assert acfg["base_model_name_or_path"] == "org/tiny"
    merged = AutoModelForCausalLM.from_pretrained(out / "merged")
    assert (
        merged.config.vocab_size
        == AutoModelForCausalLM.from_pretrained(tiny_model_dir).config.vocab_size
    )
    with pytest.raises(ConfigError, match="merge_lora merges a LoRA adapter"):
        _cfg(tiny_model_dir, store, tmp_path / "x", merge_lora=True)
