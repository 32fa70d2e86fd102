"""`pitstop compare` on run directories written to the `pitstop train` contract."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from pitstop.core.errors import DataError
from pitstop.core.run_record import StepLine
from pitstop.report.compare import compare, format_compare
from pitstop.report.runs import load_run


def run_cli(argv: list[str]) -> int:
    """Run a report subcommand through `pitstop.cli.main`, as the `pitstop` command does."""
    from pitstop import cli

    return cli.main(argv)


def make_run(
    dest: Path,
    *,
    steps: int = 40,
    tokens_per_step: int = 4096,
    step_seconds: float = 0.5,
    data_wait: float = 0.1,
    padded_tokens: int = 200_000,
    seen_tokens: int = 160_000,
    config: dict[str, Any] | None = None,
    choices: dict[str, Any] | None = None,
    findings: list[dict[str, Any]] | None = None,
    flat_phases: bool = False,
) -> Path:
    """A finished run directory: summary.json + metrics.jsonl (+ findings.json)."""
    dest.mkdir(parents=True, exist_ok=True)
    lines = []
    for s in range(1, steps + 1):
        phases = {
            "data_wait": data_wait,
            "host_to_device": 0.01,
            "forward": (step_seconds - data_wait) * 0.3,
            "backward": (step_seconds - data_wait) * 0.6,
            "optimizer": (step_seconds - data_wait) * 0.1 - 0.01,
        }
        rec: dict[str, Any] = {
            "step": s,
            "loss": 8.0 * math.exp(-s / 15) + 2.0,
            "lr": 3e-4,
            "tokens_per_second": tokens_per_step / step_seconds,
            "peak_memory_bytes": 2_000_000_000 + 1000 * s,
        }
        if flat_phases:
            rec.update({f"{k}_s": v for k, v in phases.items()})
        else:
            rec["phases"] = phases
        lines.append(json.dumps(rec))
    (dest / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    train = steps * step_seconds
    summary = {
        "trained_tokens": steps * tokens_per_step,
        "seen_tokens": seen_tokens,
        "padded_tokens": padded_tokens,
        "optimizer_steps": steps,
        "train_seconds": train,
        "wall_seconds": train + 10,
        "tokens_per_second": steps * tokens_per_step / train,
        "mfu": 0.3 * 0.5 / step_seconds,
        "peak_memory_bytes": 2_000_000_000,
        "final_loss": 8.0 * math.exp(-steps / 15) + 2.0,
        "time_breakdown": {
            "data_wait": data_wait * steps,
            "forward": (step_seconds - data_wait) * 0.3 * steps,
            "backward": (step_seconds - data_wait) * 0.6 * steps,
            "optimizer": (step_seconds - data_wait) * 0.1 * steps,
        },
        "device": {"type": "cpu", "name": "test cpu"},
        "config": {"max_seq_len": 512, "batching": "pad", "output": str(dest), **(config or {})},
        "choices": {
            "precision": {"value": "fp32", "reason": "CPU"},
            **{k: {"value": v, "reason": "test"} for k, v in (choices or {}).items()},
        },
    }
    (dest / "summary.json").write_text(json.dumps(summary))
    if findings is not None:
        (dest / "findings.json").write_text(json.dumps({"findings": findings}))
    return dest


def test_compare_metrics_and_ratios(tmp_path: Path) -> None:
    a = make_run(tmp_path / "a", step_seconds=0.5, data_wait=0.2)
    b = make_run(
        tmp_path / "b",
        step_seconds=0.25,
        data_wait=0.0,
        padded_tokens=160_000,
        config={"batching": "pack"},
        choices={"compile": "on"},
    )
    res = compare(a, b, price=2.0)
    m = {r["metric"]: r for r in res["metrics"]}
    assert m["tokens_per_second"]["a"] == pytest.approx(4096 / 0.5)
    assert m["tokens_per_second"]["ratio"] == pytest.approx(2.0)
    assert m["tokens_per_second"]["b_better"] is True
    assert m["iterations_per_second"]["a"] == pytest.approx(40 / 20)
    assert m["train_seconds"]["ratio"] == pytest.approx(0.5)
    # cost = wall seconds x 1 GPU x price: A 30 s, B 20 s
    assert m["cost"]["a"] == pytest.approx(30 / 3600 * 2.0)
    assert m["cost"]["b"] == pytest.approx(20 / 3600 * 2.0)
    # data-wait share = data_wait / sum(time_breakdown)
    assert m["data_wait_share"]["a"] == pytest.approx(0.2 * 40 / (0.2 * 40 + 0.3 * 40))
    assert m["data_wait_share"]["b"] == 0.0
    assert m["padding_waste"]["a"] == pytest.approx(1 - 160_000 / 200_000)
    assert m["padding_waste"]["b"] == pytest.approx(0.0)
    assert m["final_loss"]["b_better"] is None
    diffs = {d["setting"]: (d["a"], d["b"]) for d in res["settings_differ"]}
    assert diffs == {"batching": ("pad", "pack"), "choice.compile": ("-", "on")}
    text = format_compare(res)
    assert "tokens/s" in text and "batching" in text
    assert "2.00x  better (band 0.98-1.02x)" in text
    md = format_compare(res, markdown=True)
    assert md.count("| tokens/s (steady, all ranks) |") == 1 and "|---|" in md


def test_compare_without_price_has_no_cost(tmp_path: Path) -> None:
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b")
    res = compare(a, b)
    m = {r["metric"]: r for r in res["metrics"]}
    assert m["cost"]["a"] is None
    assert res["settings_differ"] == []
    assert "--price-per-gpu-hour" in format_compare(res)


def test_not_a_run_is_a_data_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="not a pitstop run"):
        load_run(tmp_path / "empty")
    with pytest.raises(DataError, match="not a directory"):
        load_run(tmp_path / "missing")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "summary.json").write_text("{not json")
    with pytest.raises(DataError, match="not valid JSON"):
        load_run(bad)


def test_metrics_tolerate_flat_phases_and_cut_lines(tmp_path: Path) -> None:
    run = make_run(tmp_path / "r", flat_phases=True, steps=3)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "loss": 1.0, "forw')  # a crash mid-write
    loaded = load_run(run)
    assert len(loaded.steps) == 3
    ph = loaded.steps[0].phases
    assert set(ph) == {"data_wait", "host_to_device", "forward", "backward", "optimizer"}
    assert StepLine.from_json({"step": 1, "step_s": 1.0, "forward_s": 0.5}).phases == {
        "forward": 0.5
    }


def test_compare_cli_json_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b", step_seconds=0.4)
    assert run_cli(["compare", str(a), str(b), "--json", "--price-per-gpu-hour", "1.5"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["price_per_gpu_hour"] == 1.5
    assert run_cli(["compare", str(a), str(tmp_path / "nope")]) == 1
    assert "not a directory" in capsys.readouterr().err
    assert run_cli(["compare", str(a), str(b), "--price-per-gpu-hour", "x"]) == 2
