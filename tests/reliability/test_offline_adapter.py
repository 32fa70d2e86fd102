"""Saving a LoRA adapter never asks the Hub (issue 33 item 7).

peft's default `save_embedding_layers="auto"` checks on the Hub whether the base's
vocabulary changed when the adapter names its base by a Hub id (what pitstop writes for a
Hub-cache model): an offline machine waited for time-outs at every checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["q_proj", "embed_tokens"]])
def test_an_adapter_of_a_hub_model_saves_offline(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch, targets: list[str]
) -> None:
    import peft
    import peft.utils.save_and_load as peft_save
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from pitstop.train.model_io import save_model_dir

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"the Hub was asked: {args}")

    monkeypatch.setattr(peft_save, "check_file_exists_on_hf_hub", no_network)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=targets))
    model.peft_config["default"].base_model_name_or_path = "org/tiny"  # as pitstop names it
    dest = tmp_path / "adapter"
    dest.mkdir()
    save_model_dir(model, None, dest, None)
    assert json.loads((dest / "adapter_config.json").read_text())["base_model_name_or_path"] == (
        "org/tiny"
    )
    with safe_open(str(dest / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert any("lora_A" in k for k in keys)
    # The embedding matrix is saved exactly when LoRA adapts it (what "auto" decided offline).
    has_embedding_weight = any(k.endswith("embed_tokens.base_layer.weight") or
                               k.endswith("embed_tokens.weight") for k in keys)  # fmt: skip
    assert has_embedding_weight == ("embed_tokens" in targets)
