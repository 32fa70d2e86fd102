"""`pitstop estimate` says what its own numbers support (issue 24, item 4): a measured run's
settings are kept, checkpoint overhead is modelled with the step count printed, the hints
match the options table, and the MFU note names the estimate's precision."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from test_report_compare import make_run

from pitstop.commands.estimate import register
from pitstop.measure import cost_model as C
from pitstop.report.estimate import DataTokens, EstimateRequest, estimate, format_estimate
from pitstop.report.gpus import get_gpu
from pitstop.report.measured import Measured, load_measured
from pitstop.report.planned import estimate_planned_run, profile_settings

LLAMA_1B = {
    "model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632,
    "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
    "vocab_size": 32000,
}  # fmt: skip
TOKENS = DataTokens(10**9, 10**9, None, 1024, "test")


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(LLAMA_1B))
    return d


def test_from_profile_keeps_the_runs_own_settings(tmp_path: Path, model_dir: Path) -> None:
    """The issue: the run's gradient checkpointing was dropped, its 2 × 768 shown as 1 × 1024."""
    cfg = {"gradient_checkpointing": True, "micro_batch_size": 2, "max_seq_len": 768}
    run = make_run(tmp_path / "run", config=cfg)
    est = estimate_planned_run(model=str(model_dir), tokens=10**6, from_profile=str(run))
    assert est.gradient_checkpointing is True
    assert est.memory is not None
    assert (est.memory.micro_batch_size, est.memory.seq_len) == (2, 768)
    assert not any("scaled by" in a for a in est.assumptions)  # same setting: no rescaling
    kept = next(a for a in est.assumptions if a.startswith("kept from the measured run"))
    assert "gradient checkpointing on" in kept and "micro-batch 2 rows" in kept
    # Told otherwise, the flags win and the measured time is rescaled by the FLOPs ratio.
    off = estimate_planned_run(
        model=str(model_dir), tokens=10**6, from_profile=str(run), gradient_checkpointing=False,
        micro_batch_size=4,
    )  # fmt: skip
    assert off.gradient_checkpointing is False and off.memory.micro_batch_size == 4
    assert any("scaled by" in a for a in off.assumptions)
    assert off.train_seconds < est.train_seconds


def test_profile_settings_of_hf_arguments() -> None:
    cfg = {"gradient_checkpointing": True, "per_device_train_batch_size": 4,
           "max_length": 2048, "optim": "paged_adamw_8bit"}  # fmt: skip
    prof = Measured("args.json", 1.0, "cpu", config=cfg)
    assert profile_settings(prof) == {
        "gradient_checkpointing": True, "max_seq_len": 2048, "micro_batch_size": 4,
        "optimizer": "adamw_8bit",
    }  # fmt: skip


def test_checkpoint_overhead_and_step_count() -> None:
    shape = C.shape_from_config(LLAMA_1B)
    kw = {"tokens": TOKENS, "seq_len": 1024, "micro_batch_size": 8, "gpu": get_gpu("H100")}
    plain = estimate(shape, EstimateRequest(**kw))
    saved = estimate(shape, EstimateRequest(save_steps=500, **kw))
    steps = 10**9 // (8 * 1024) + 1
    assert plain.optimizer_steps == saved.optimizer_steps == steps
    ck = saved.checkpoints
    assert ck is not None and ck["saves"] == steps // 500 and ck["bandwidth_assumed"]
    plan = C.Plan(micro_batch_size=8, seq_len=1024)
    assert ck["bytes_per_save"] == C.checkpoint_bytes(shape, plan)  # weights + AdamW: 12 B/param
    assert ck["bytes_per_save"] == shape.params().total * 12
    assert ck["seconds_per_save"] == pytest.approx(
        ck["bytes_per_save"] / C.ASSUMED_WRITE_BYTES_PER_SECOND, rel=1e-3
    )
    assert saved.train_seconds == pytest.approx(plain.train_seconds + ck["added_seconds"])
    text = format_estimate(saved)
    assert f"{steps:,} optimizer steps" in text and "ASSUMED" in text and "--save-steps 500" in text
    fast = estimate(shape, EstimateRequest(save_steps=500, disk_write_gbps=5.0, **kw))
    assert fast.checkpoints["added_seconds"] == pytest.approx(ck["added_seconds"] / 10, rel=1e-3)


def test_measured_save_pauses_are_not_added_twice(tmp_path: Path) -> None:
    prof = {"step_seconds": [1.0] * 10, "tokens_per_step": 8192, "tokens_per_second": 8192.0,
            "phases": {"checkpoint": 2.0}, "warmup": 1, "device": {"type": "cpu"}}  # fmt: skip
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof), encoding="utf-8")
    shape = C.shape_from_config(LLAMA_1B)
    est = estimate(
        shape,
        EstimateRequest(tokens=TOKENS, seq_len=1024, profile=load_measured(path), save_steps=100),
    )
    assert est.checkpoints is not None and est.checkpoints["added_seconds"] == 0
    assert "already holds" in est.checkpoints["basis"]
    assert est.optimizer_steps == -(-(10**9) // 8192)


def test_hints_match_the_options_table() -> None:
    """No "shard across GPUs (the options above)" when every option says it does not fit."""
    big = C.shape_from_params(70e9)
    est = estimate(
        big,
        EstimateRequest(tokens=TOKENS, seq_len=4096, gpu=get_gpu("RTX 4090"), gpu_counts=[1, 2]),
    )
    assert not any(r["fits"] for r in est.options)
    text = format_estimate(est)
    assert "shard across" not in text and "no GPU count above fits" in text
    h100 = estimate(
        C.shape_from_params(8e9),
        EstimateRequest(tokens=TOKENS, seq_len=2048, gpu=get_gpu("H100"), gpu_counts=[1, 2, 4, 8]),
    )
    first = min(r["gpus"] for r in h100.options if r["gpus"] > 1 and r["fits"])
    assert f"shard across {first} or more GPUs" in format_estimate(h100)
    # Every row's fit is its per-GPU memory against the same usable figure, FSDP included.
    for r in h100.options:
        assert r["fits"] == (r["memory_per_gpu_bytes"] <= h100.usable_bytes)


def test_mfu_note_names_the_estimates_precision() -> None:
    shape = C.shape_from_config(LLAMA_1B)
    for precision in ("fp16", "bf16"):
        est = estimate(
            shape,
            EstimateRequest(
                tokens=TOKENS, seq_len=1024, gpu=get_gpu("A100 80GB"), precision=precision
            ),
        )
        other = "bf16" if precision == "fp16" else "fp16"
        basis = est.time_basis
        assert f"here {precision}" in basis and f"{precision} dense peak" in basis
        assert other not in basis


def test_estimate_flags(tmp_path: Path, model_dir: Path, capsys) -> None:
    parser = argparse.ArgumentParser(prog="pitstop")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["estimate", "--model", str(model_dir), "--tokens", "100000000", "--gpu", "H100",
         "--save-steps", "200", "--tokens-per-step", "65536", "--disk-write-gbps", "2", "--json"]
    )  # fmt: skip
    assert args.func(args) == 0
    t = json.loads(capsys.readouterr().out)["time"]
    assert t["optimizer_steps"] == -(-100_000_000 // 65536)
    assert t["checkpoints"]["saves"] == t["optimizer_steps"] // 200
    assert t["checkpoints"]["bandwidth_assumed"] is False


def test_a_cpu_profile_is_estimated_in_the_precision_it_trained_in(
    tmp_path: Path, model_dir: Path
) -> None:
    """A CPU run that measured bf16 faster trained in bf16: its estimate is a bf16 plan."""
    run = make_run(tmp_path / "bf16", choices={"precision": "bf16"})
    est = estimate_planned_run(model=str(model_dir), tokens=10**6, from_profile=str(run))
    assert est.memory is not None and est.memory.precision == "bf16"
    fp32 = make_run(tmp_path / "fp32")  # no recorded precision: the CPU's old default
    est = estimate_planned_run(model=str(model_dir), tokens=10**6, from_profile=str(fp32))
    assert est.memory is not None and est.memory.precision == "fp32"
