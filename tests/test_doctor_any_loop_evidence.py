"""Evidence never shows a value the run did not record (issue 36, item 5).

A plain PyTorch loop profiled by pitstop.watch records only what its hooks observe
(pitstop.anyloop.timer `Watch._args`): precision, checkpointing, accumulation and the
DataLoader's batch size and workers. Its optimizer (fused or not), row length, collator,
logging and saving are not recorded. `doctor --profile` once read that record as a
TrainingArguments file and filled the rest with defaults: `fused_optimizer: True` for an
unfused torch.optim.AdamW, and `plan={micro_batch_size: 1, seq_len: 8192}` for 2 rows of 512.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

import pitstop
from pitstop.advise import hf_args
from pitstop.advise.doctor import doctor, make_setup
from pitstop.advise.setup import UNKNOWN, is_custom_loop
from pitstop.probe import DeviceInfo

pytestmark = pytest.mark.usefixtures("one_thread")

ENV = {"transformers": "5.23.0", "flash_attn": {"installed": None}, "tf32": {}, "compile": {}}
A100 = DeviceInfo(
    type="cuda", name="NVIDIA A100-SXM4-80GB", capability=(8, 0), bf16=True,
    total_memory_bytes=80 * 2**30, cpu_count=16,
)  # fmt: skip
# What Watch._args can record of a loop (timer.py); nothing else may reach the evidence.
RECORDABLE = {
    "bf16", "fp16", "gradient_checkpointing", "gradient_accumulation_steps", "max_steps",
    "report_to", "per_device_train_batch_size", "dataloader_num_workers",
    "dataloader_pin_memory", "dataloader_persistent_workers", "dataloader_prefetch_factor",
    "tf32", "save_strategy", "save_steps",
}  # fmt: skip
ROWS, ROW_LEN, ACCUM = 2, 512, 4
REAL_DEFAULTS = hf_args.training_args_defaults
# Evidence keys that name a setting, and the field that records it: where the run did not
# record the field, the evidence says None or "unknown".
SETTING_KEYS = {
    "optim": "optim", "optimizer": "optim", "fused_optimizer": "optim",
    "seq_len": "max_length", "micro_batch_tokens": "max_length", "max_len": "max_length",
    "batching": "packing", "compile": "torch_compile", "compile_works_here": "torch_compile",
    "save_steps": "save_steps", "log_steps": "logging_steps", "logging_steps": "logging_steps",
    "eval_steps": "eval_steps", "torch_empty_cache_steps": "torch_empty_cache_steps",
    "tf32": "tf32", "nan_inf_filter": "logging_nan_inf_filter",
}  # fmt: skip


@pytest.fixture(scope="module")
def loop_profile(tiny_model_dir: Path) -> dict[str, Any]:
    """The issue's accumulation loop, scaled down: 2 x 512 rows, accumulation 4, unfused
    torch.optim.AdamW, gradient checkpointing, timed in-process by pitstop.watch."""
    import torch
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.gradient_checkpointing_enable()
    rows = [{"input_ids": torch.randint(5, 100, (ROW_LEN,))} for _ in range(ROWS * ACCUM * 3)]
    for r in rows:
        r["labels"] = r["input_ids"].clone()
    loader = DataLoader(rows, batch_size=ROWS)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=False, foreach=False)
    w = pitstop.watch(print_report=False, doctor=False).start()
    for i, batch in enumerate(loader, 1):
        (model(**batch).loss / ACCUM).backward()
        if i % ACCUM == 0:
            opt.step()
            opt.zero_grad()
    w.stop()
    assert w.profile is not None
    return w.profile


def _leaves(value: Any, key: str = "") -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [x for k, v in value.items() for x in _leaves(v, str(k))]
    return [(key, value)]


def _poisoned_defaults() -> dict[str, Any]:
    """TrainingArguments defaults changed wherever a rule could read one: a finding that
    depends on a default the loop never set changes with them."""
    d = dict(REAL_DEFAULTS())
    d.update(optim="adamw_torch_fused", per_device_train_batch_size=7, torch_compile=True,
             save_strategy="steps", save_steps=3, logging_strategy="steps", logging_steps=1,
             eval_strategy="steps", eval_steps=5, tf32=True, torch_empty_cache_steps=11,
             logging_nan_inf_filter=False, max_length=8192, group_by_length=True,
             dataloader_num_workers=31)  # fmt: skip
    return d


def _run(profile: dict[str, Any], model: Path, *, as_callback: bool) -> list[dict[str, Any]]:
    """`doctor --profile` (as_callback=False) or the recorder's in-process call (True)."""
    kw: dict[str, Any] = {"hf_args": profile["config"]} if as_callback else {}
    report = doctor(profile=profile, model=model, environment=ENV, compile_check=False,
                    disk_check=False, **kw)  # fmt: skip
    return report["findings"]


def test_the_profile_records_only_what_the_hooks_observe(loop_profile: dict[str, Any]) -> None:
    cfg = loop_profile["config"]
    assert set(cfg) <= RECORDABLE, set(cfg) - RECORDABLE
    assert cfg["per_device_train_batch_size"] == ROWS
    assert cfg["gradient_accumulation_steps"] == ACCUM
    assert is_custom_loop(loop_profile)


def test_unrecorded_setup_fields_are_unknown(loop_profile: dict[str, Any]) -> None:
    for s in (make_setup(profile=loop_profile),
              make_setup(hf_args=loop_profile["config"], profile=loop_profile)):  # fmt: skip
        assert s.custom_loop and s.recorded == frozenset(loop_profile["config"])
        # recorded: as observed
        assert (s.micro_batch_rows, s.grad_accum, s.loader_workers) == (ROWS, ACCUM, 0)
        assert s.gradient_checkpointing is True and s.precision == "fp32"
        # not recorded: never a TrainingArguments default
        assert s.optimizer is None and s.max_len is None
        assert s.batching == UNKNOWN and s.compile == UNKNOWN
        assert (s.log_steps, s.eval_steps, s.empty_cache_steps) == (None,) * 3
        assert s.nan_inf_filter is None
        if "tf32" not in s.recorded:  # recorded where the timer reads the TF32 flags
            assert s.tf32 is None
        if "save_steps" not in s.recorded:  # recorded where the loop called torch.save
            assert s.save_steps is None
    # A declared TrainingArguments file still takes the documented defaults.
    declared = make_setup(hf_args={"per_device_train_batch_size": 2})
    assert declared.optimizer and declared.batching == "dynamic" and declared.recorded is None


@pytest.mark.parametrize("device", ["recorded", "a100"])
@pytest.mark.parametrize("as_callback", [False, True])
def test_evidence_never_shows_an_unrecorded_value(
    loop_profile: dict[str, Any],
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    device: str,
    as_callback: bool,
) -> None:
    profile = copy.deepcopy(loop_profile)
    if device == "a100":  # the GPU rules too (fused optimizer, compile, flash attention)
        profile["device"] = A100.to_dict()
    found = _run(profile, tiny_model_dir, as_callback=as_callback)
    ids = {f["id"] for f in found}
    recorded = set(profile["config"])
    assert "gradient-checkpointing-unneeded" in ids  # the finding: it fires, honestly
    for f in found:
        for key, value in _leaves(f["evidence"]):
            if SETTING_KEYS.get(key, "") not in (recorded | {""}):
                assert value is None or value == UNKNOWN, (f["id"], key, value)
            if not key.endswith("_at_most"):  # a bound says it is one
                assert value != 8192, (f["id"], key)  # 2 rows x the model's 4096 positions
    ck = next(f for f in found if f["id"] == "gradient-checkpointing-unneeded")
    plan = ck["evidence"]["plan"]
    assert plan["micro_batch_size"] == ROWS  # recorded
    assert plan["seq_len"] == UNKNOWN and plan["seq_len_at_most"] == 4096  # a bound, labelled
    assert plan["fused_optimizer"] == UNKNOWN and plan["optimizer"] == UNKNOWN
    assert ck["fix"].startswith("drop the model.gradient_checkpointing_enable() call")
    # Every finding is the same whatever TrainingArguments' defaults are: none depends on one.
    monkeypatch.setattr(hf_args, "training_args_defaults", _poisoned_defaults)
    assert _run(profile, tiny_model_dir, as_callback=as_callback) == found


def test_custom_loop_rules_read_only_the_record() -> None:
    """The Trainer's accumulation bug is not a custom loop's (it scales its own loss); a
    measured padding share shows padded rows although the collator is unknown."""
    from pitstop.advise.rules import Context, run_rules
    from pitstop.advise.setup import CUSTOM_LOOP_NOTE
    from pitstop.measure.schema import make_profile

    record = {"bf16": False, "fp16": False, "gradient_checkpointing": False,
              "gradient_accumulation_steps": ACCUM, "max_steps": 11, "report_to": [],
              "per_device_train_batch_size": ROWS, "dataloader_num_workers": 2}  # fmt: skip
    rec = {"forward": 0.03, "backward": 0.06, "optimizer": 0.01}
    prof = make_profile([rec] * 10, [0.1] * 10, warmup=1, source="hf", trained_tokens=1e5,
                        config=record, notes=[CUSTOM_LOOP_NOTE])  # fmt: skip
    prof.update(seen_tokens=600, padded_tokens=1000)
    ctx = Context(setup=make_setup(profile=prof), device=A100, profile=prof,
                  env={**ENV, "transformers": "4.40.0"})  # fmt: skip
    fired = {f.id: f for f in run_rules(ctx)}
    assert "ga-loss-bug" not in fired
    f = fired["packing-off"]
    assert f.evidence["batching"] == UNKNOWN and f.evidence["padding_fraction"] == 0.4
    assert f.fix.startswith("pack the rows") and "SFTConfig" not in f.fix
