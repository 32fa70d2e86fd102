"""`estimate` counts gradient checkpointing's recomputation, and never shows an MFU above 100%."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_report_compare import make_run

from pitstop.measure.cost_model import ModelShape
from pitstop.report.estimate import (
    DataTokens,
    EstimateRequest,
    estimate,
    format_estimate,
    recompute_per_token,
)
from pitstop.report.gpus import get_gpu
from pitstop.report.measured import load_measured

SHAPE = ModelShape(layers=2, hidden=64, intermediate=172, heads=4, kv_heads=4, vocab=4096)
TOKENS = DataTokens(10**10, 10**10, None, 128, "test")


def test_checkpointing_adds_the_recomputed_forward_to_time_and_cost() -> None:
    # A 1B-shaped model in micro-batches of 8 x 2048: its compute time is far above the
    # estimate's per-micro-step overhead floor, so time scales with FLOPs (the tiny SHAPE in
    # rows of 128 on an H100 sits on the floor).
    big = ModelShape(layers=16, hidden=2048, intermediate=5504, heads=16, kv_heads=16, vocab=32000)
    kw = {"tokens": TOKENS, "seq_len": 2048, "micro_batch_size": 8, "gpu": get_gpu("H100"),
          "mfu": 0.5, "price": 2.0}  # fmt: skip
    off = estimate(big, EstimateRequest(**kw))
    on = estimate(big, EstimateRequest(gradient_checkpointing=True, **kw))
    n = big.params().non_embedding
    extra = 2 * n + 4 * 16 * 2048 * 2048  # the forward pass again: 2N + 4·L·d·T
    assert on.flops_per_token == pytest.approx(off.flops_per_token + extra)
    assert on.train_seconds == pytest.approx(
        off.train_seconds * on.flops_per_token / off.flops_per_token
    )
    assert on.to_dict()["cost"]["total"] > off.to_dict()["cost"]["total"]
    assert "recomputed" in format_estimate(on) and "recomputed" not in format_estimate(off)


def test_a_profile_without_checkpointing_is_scaled_up(tmp_path: Path) -> None:
    prof = load_measured(make_run(tmp_path / "run", config={"gradient_checkpointing": False}))
    off = estimate(
        SHAPE, EstimateRequest(tokens=TOKENS, seq_len=128, precision="fp32", profile=prof)
    )
    on = estimate(
        SHAPE,
        EstimateRequest(
            tokens=TOKENS, seq_len=128, precision="fp32", profile=prof, gradient_checkpointing=True
        ),
    )
    fpt = off.flops_per_token
    factor = (fpt + recompute_per_token(_fm(), 128)) / fpt
    start = off.throughput.startup_seconds
    assert on.train_seconds - start == pytest.approx((off.train_seconds - start) * factor)
    assert any("scaled by" in a for a in on.assumptions)


def _fm():
    from pitstop.measure.flops import FlopsModel

    return FlopsModel(SHAPE.params().non_embedding, 0, SHAPE.layers, SHAPE.hidden)


def test_mfu_above_one_is_not_shown(tmp_path: Path) -> None:
    p = tmp_path / "profile.json"
    p.write_text(json.dumps({"tokens_per_second": 2000.0, "mfu": 2.11, "device": {"type": "cpu"}}))
    est = estimate(
        SHAPE, EstimateRequest(tokens=TOKENS, precision="fp32", profile=load_measured(p))
    )
    assert est.throughput.mfu is None and est.to_dict()["time"]["mfu"] is None
    assert "measured low" in est.time_basis


def test_a_plan_that_does_not_fit_lists_the_memory_options_that_do() -> None:
    from pitstop.measure.cost_model import shape_from_params

    shape = shape_from_params(8e9)
    kw = {"tokens": TOKENS, "seq_len": 2048, "gpu": get_gpu("H100"), "mfu": 0.4}
    est = estimate(shape, EstimateRequest(**kw))
    assert est.memory is not None and est.usable_bytes is not None
    assert est.memory.peak > est.usable_bytes  # a full fine-tune of 8B: 16 B/param
    opts = {r["flags"]: r for r in est.memory_options}
    fits = [r["fits"] for r in est.memory_options]
    assert fits == sorted(fits, reverse=True)  # the ones that fit first
    assert opts["--optimizer adamw_8bit"]["peak_bytes"] < est.memory.peak  # ~6 B/param less
    assert opts["--lora-r 16 --load-in-4bit --gradient-checkpointing"]["fits"]
    for r in est.memory_options:  # each peak is estimate_memory's for those settings
        assert r["fits"] == (r["peak_bytes"] <= est.usable_bytes)
    text = format_estimate(est)
    assert (
        "memory options, cheapest first" in text
        and "one H100 is not enough" in text
        and "--optimizer adamw_8bit" in text
    )
    assert est.to_dict()["memory_options"] == est.memory_options
    small = estimate(SHAPE, EstimateRequest(**kw))  # fits: nothing to suggest
    assert small.memory_options == [] and "memory options" not in format_estimate(small)


def test_memory_options_keep_the_plans_gradient_accumulation() -> None:
    """An option is priced for the run it describes: with accumulation, the gradients kept
    across micro-batches count (priced at grad_accum=1 they were left out, and an option
    could say it fits when that run would not)."""
    from dataclasses import replace

    from pitstop.measure.cost_model import Plan, estimate_memory, shape_from_params
    from pitstop.report.estimate import memory_options

    shape = shape_from_params(8e9)
    plan = Plan(micro_batch_size=1, seq_len=2048, grad_accum=8)
    rows = {r["flags"]: r for r in memory_options(shape, plan, usable=80 * 2**30)}
    for flags, changes in (
        ("--optimizer adamw_8bit", {"optimizer": "adamw_8bit"}),
        ("--lora-r 16", {"lora_r": 16}),
    ):
        kept = estimate_memory(shape, replace(plan, **changes)).peak
        dropped = estimate_memory(shape, replace(plan, grad_accum=1, **changes)).peak
        assert rows[flags]["peak_bytes"] == kept > dropped
