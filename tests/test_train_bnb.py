"""bitsandbytes on the CPU: 8-bit AdamW and QLoRA (4-bit NF4 base + LoRA) train, resume
exactly and save; without bitsandbytes both are refused with the install command."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from pitstop.core.errors import MissingDependencyError

bnb = pytest.importorskip("bitsandbytes")


def _cfg(model, store, out, **over):
    from _train_util import train_config

    return train_config(model, store, out, **over)


def _losses(out: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_8bit_adamw_trains_with_8bit_moments(tiny_model_dir, store, tmp_path):
    from pitstop.train.trainer import Trainer

    tr = Trainer.from_config(_cfg(tiny_model_dir, store, tmp_path / "o", optimizer="adamw_8bit",
                      adam_betas="0.9,0.99", max_steps=8))  # fmt: skip
    s = tr.fit().to_json()
    assert s["choices"]["optimizer"]["value"] == "adamw_8bit"
    assert isinstance(tr.run.optimizer, bnb.optim.AdamW8bit)
    assert all(g["betas"] == (0.9, 0.99) for g in tr.run.optimizer.param_groups)
    opt = tr.run.optimizer
    states = [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]
    assert any(t.dtype == torch.uint8 for t in states)  # the moments really are 8-bit
    losses = _losses(tmp_path / "o")
    assert sum(losses[-2:]) < sum(losses[:2])


def test_without_bitsandbytes_8bit_and_4bit_are_refused(
    tiny_model_dir, store, tmp_path, monkeypatch
):
    from pitstop.probe import DeviceInfo, four_bit_problem
    from pitstop.train import run

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import raises ImportError
    with pytest.raises(MissingDependencyError, match=r"pip install 'bitsandbytes>=0.45'"):
        run(_cfg(tiny_model_dir, store, tmp_path / "o", optimizer="paged_adamw_8bit"))
    assert "pip install 'bitsandbytes>=0.45'" in four_bit_problem(
        DeviceInfo(type="cpu", name="test cpu", cpu_count=2)
    )


def test_qlora_trains_resumes_exactly_and_saves_the_adapter(
    tiny_model_dir, store, tmp_path, monkeypatch
):
    import peft
    from transformers import AutoModelForCausalLM

    from pitstop.train import run
    from pitstop.train.trainer import RunInterrupted, Trainer

    kw = {"lora_r": 8, "load_in_4bit": True, "lr": 5e-3, "max_steps": 6}
    ref = tmp_path / "ref"
    tr = Trainer.from_config(_cfg(tiny_model_dir, store, ref, **kw))
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in tr.run.model.modules())
    tr.fit()
    losses = _losses(ref)
    assert sum(losses[-2:]) < sum(losses[:2])

    out = tmp_path / "cut"
    monkeypatch.setenv("PITSTOP_TEST_STOP_AT_STEP", "3")
    with pytest.raises(RunInterrupted):
        run(_cfg(tiny_model_dir, store, out, **kw))
    monkeypatch.delenv("PITSTOP_TEST_STOP_AT_STEP")
    s = run(_cfg(tiny_model_dir, store, out, resume=True, **kw))
    assert s["resumed_from"].endswith("step-3")
    assert _losses(out) == losses  # bit-identical continuation

    from safetensors.torch import load_file

    a = load_file(ref / "final" / "adapter_model.safetensors")
    b = load_file(out / "final" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = peft.PeftModel.from_pretrained(base, out / "final")
    assert any("lora_" in n for n, _ in model.named_parameters())
