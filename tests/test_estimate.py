"""`pitstop estimate`: time, cost, the options table and the command's errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_report_compare import make_run, run_cli

from pitstop.core.errors import ConfigError, DataError
from pitstop.measure.cost_model import ModelShape
from pitstop.report.estimate import (
    DEFAULT_MFU,
    STEP_FLOOR_SECONDS,
    DataTokens,
    EstimateRequest,
    data_tokens,
    estimate,
    format_estimate,
    options_table,
)
from pitstop.report.gpus import find_gpu, get_gpu
from pitstop.report.measured import load_measured

SHAPE = ModelShape(layers=2, hidden=64, intermediate=256, heads=4, kv_heads=2, vocab=1000)
TOKENS = DataTokens(1_000_000, 1_000_000, None, None, "test")


def test_gpu_names() -> None:
    assert find_gpu("NVIDIA H100 80GB HBM3").name == "H100"
    assert find_gpu("NVIDIA H100 PCIe").name == "H100 PCIe"
    assert find_gpu("NVIDIA A100-SXM4-40GB").name == "A100 40GB"
    assert find_gpu("rtx4090").name == "RTX 4090"
    assert find_gpu("a100").name == "A100 80GB"
    assert get_gpu("H100").peak_flops("bf16")[0] == pytest.approx(989.4e12)
    with pytest.raises(ConfigError, match="did you mean 'H100'"):
        get_gpu("H10O")


def test_time_from_flops_and_a_gpu() -> None:
    # A micro-batch large enough that the per-step overhead floor stays below the FLOPs time.
    est = estimate(
        SHAPE,
        EstimateRequest(
            tokens=TOKENS,
            seq_len=128,
            micro_batch_size=100_000,
            gpu=get_gpu("H100"),
            mfu=0.5,
            price=2.0,
        ),
    )
    fpt = 6 * 187_200 + 12 * 2 * 64 * 128
    assert est.flops_per_token == fpt
    pps = 0.5 * 989.4e12 / fpt
    assert est.train_seconds == pytest.approx(1_000_000 / pps)
    assert est.to_dict()["cost"]["total"] == pytest.approx(est.train_seconds / 3600 * 2.0, abs=1e-4)
    assert "MFU 50% (--mfu)" in est.time_basis
    default = estimate(SHAPE, EstimateRequest(tokens=TOKENS, seq_len=128, gpu=get_gpu("H100")))
    assert default.throughput.mfu == DEFAULT_MFU and "ASSUMPTION" in default.time_basis
    # Micro-batches of one row: 7,813 micro-steps, bound by the stated per-step floor.
    assert default.train_seconds == pytest.approx(1_000_000 / 128 * STEP_FLOOR_SECONDS)
    assert any("time floor" in a for a in default.assumptions)
    assert "EXAMPLE price" in default.price_basis


def test_packing_efficiency_and_epochs_scale_the_work() -> None:
    packed = DataTokens(1_000_000, 900_000, 0.8, 128, "test")
    a = estimate(SHAPE, EstimateRequest(tokens=TOKENS, seq_len=128, gpu=get_gpu("A10"), mfu=0.3))
    b = estimate(SHAPE, EstimateRequest(tokens=packed, epochs=2, gpu=get_gpu("A10"), mfu=0.3))
    assert b.train_seconds == pytest.approx(a.train_seconds * 2 / 0.8)


def test_time_from_a_measured_run(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", steps=40, tokens_per_step=4096, step_seconds=0.5)
    prof = load_measured(run)  # a run directory: its summary.json
    est = estimate(SHAPE, EstimateRequest(tokens=TOKENS, precision="fp32", profile=prof))
    # trained tokens / measured tokens/s + start-up (wall - train = 10 s) once
    assert est.train_seconds == pytest.approx(1_000_000 / 8192 + 10)
    assert "measured" in est.time_basis and "start-up 10 s" in est.time_basis
    assert [o["gpus"] for o in est.options] == [1]  # a CPU profile: no GPU options
    assert est.price is None and "give --price-per-gpu-hour" in est.price_basis
    p = tmp_path / "profile.json"
    p.write_text(
        json.dumps({"tokens_per_second": 2000.0, "mfu": 0.4, "device": "NVIDIA A100-SXM4-80GB"})
    )
    gpu_prof = load_measured(p)
    same = estimate(SHAPE, EstimateRequest(tokens=TOKENS, profile=gpu_prof))
    assert same.train_seconds == pytest.approx(500.0) and same.gpu.name == "A100 80GB"
    # on another GPU, the profile's MFU (measured on a GPU) carries over to that GPU's peak
    other = estimate(
        SHAPE, EstimateRequest(tokens=TOKENS, seq_len=128, profile=gpu_prof, gpu=get_gpu("H100"))
    )
    assert other.throughput.mfu == 0.4 and "measured on NVIDIA A100" in other.time_basis
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(DataError, match="no tokens_per_second"):
        load_measured(tmp_path / "bad.json")


def test_options_table_verdicts() -> None:
    rows = options_table(seconds_1=3600, startup=0, gpu_counts=[1, 2, 4], scaling=0.9,
                         price=2.0, memory=None, usable=None)  # fmt: skip
    assert [r["speedup"] for r in rows] == [1.0, 1.8, pytest.approx(3.24)]
    assert rows[1]["train_seconds"] == pytest.approx(2000.0)
    assert rows[1]["cost"] == pytest.approx(2000 / 3600 * 2 * 2.0, abs=0.01)
    assert "1.80x sooner for +11% cost" in rows[1]["verdict"]
    ideal = options_table(seconds_1=3600, startup=0, gpu_counts=[1, 2], scaling=1.0,
                          price=2.0, memory=None, usable=None)  # fmt: skip
    assert "about the same cost" in ideal[1]["verdict"]


def test_options_switch_to_fsdp_when_one_gpu_is_not_enough() -> None:
    big = ModelShape(layers=32, hidden=4096, intermediate=11008, heads=32, kv_heads=32, vocab=32000)
    est = estimate(
        big,
        EstimateRequest(
            tokens=TOKENS, seq_len=2048, gpu=get_gpu("H100"), gradient_checkpointing=True
        ),
    )
    assert est.options[0]["fits"] is False and est.max_micro_batch == 0
    assert [o["strategy"] for o in est.options] == ["single", "FSDP", "FSDP", "FSDP"]
    assert est.options[-1]["fits"] is True  # 8-way sharded states fit
    assert "one H100 is not enough" in format_estimate(est)
    small = estimate(SHAPE, EstimateRequest(tokens=TOKENS, seq_len=128, gpu=get_gpu("H100")))
    assert [o["strategy"] for o in small.options] == ["single", "DDP", "DDP", "DDP"]
    assert small.max_micro_batch > 100


def test_tokens_from_a_store_manifest(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    stats = {"tokens": 5000, "target_tokens": 4000, "max_seq_len": 256,
             "packing": {"efficiency": 0.9}}  # fmt: skip
    (store / "manifest.json").write_text(json.dumps({"n_tokens": 5000, "stats": stats}))
    t = data_tokens(str(store), None)
    assert (t.tokens, t.trained_tokens, t.packing_efficiency, t.max_seq_len) == (
        5000,
        4000,
        0.9,
        256,
    )
    with pytest.raises(DataError):
        data_tokens(str(tmp_path / "missing"), None)
    with pytest.raises(ConfigError):
        data_tokens(None, None)


def test_tokens_from_a_dataset_file(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(json.dumps({"text": f"document number {i} " * 20}) + "\n" for i in range(30))
    )
    t = data_tokens(str(data), None, model_dir=str(tiny_model_dir), max_seq_len=128,
                    cache_dir=str(tmp_path / "cache"))  # fmt: skip
    assert t.tokens > 30 * 20 and t.max_seq_len == 128
    with pytest.raises(ConfigError, match="needs the tokenizer"):
        data_tokens(str(data), None)


def test_cli_json(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["estimate", "--model", str(tiny_model_dir), "--tokens", "1e11", "--gpu", "RTX 4090",
            "--max-seq-len", "512", "--micro-batch-size", "4", "--json"]  # fmt: skip
    assert run_cli(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"memory", "time", "cost", "options"}
    assert out["memory"]["peak_bytes"] > out["memory"]["weights_bytes"] > 0
    assert out["time"]["train_seconds"] > 0 and out["time"]["basis"].startswith("computed")
    assert len(out["options"]) == 4 and out["cost"]["total"] > 0
    assert run_cli(argv[:-1]) == 0
    assert "Options" in capsys.readouterr().out


def test_cli_reports_every_bad_flag_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    rc = run_cli(["estimate", "--params", "1e9", "--tokens", "x", "--gpu", "H10", "--mfu", "3",
                  "--gpus", "1,two"])  # fmt: skip
    assert rc == 2
    err = capsys.readouterr().err
    for part in ("--tokens x: must be an integer", "did you mean 'H100'", "--mfu 3: must be",
                 "--gpus 1,two: must be"):  # fmt: skip
        assert part in err
    assert run_cli(["estimate", "--params", "1e9", "--tokens", "1000"]) == 2
    assert "give --gpu NAME" in capsys.readouterr().err


def _real_run(dest: Path, step_seconds: list[float], checkpoint_s: dict[int, float] | None = None):
    """A run directory as `pitstop train` writes it (per-step step_seconds and tokens)."""
    dest.mkdir(parents=True)
    lines = []
    for i, sec in enumerate(step_seconds, 1):
        ck = (checkpoint_s or {}).get(i, 0.0)
        lines.append({"step": i, "step_seconds": sec, "step_trained_tokens": 1000,
                      "checkpoint_s": ck, "eval_s": 0.0})  # fmt: skip
    (dest / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    train = sum(step_seconds)
    summary = {"tokens_per_second": 1000 * len(step_seconds) / train, "train_seconds": train,
               "wall_seconds": train + 4.0, "device": {"type": "cpu", "name": "test"}}  # fmt: skip
    (dest / "summary.json").write_text(json.dumps(summary))
    return dest


def test_a_short_run_predicts_from_its_steady_steps(tmp_path: Path) -> None:
    # two slow warm-up steps (a process's first steps), then 1 s steps with one 3x stall
    run = _real_run(tmp_path / "run", [6.0, 4.0] + [1.0] * 9 + [3.0])
    est = estimate(
        SHAPE, EstimateRequest(tokens=TOKENS, precision="fp32", profile=load_measured(run))
    )
    # the steady steps' tokens over their seconds: the stall counts (a median dropped it)
    assert est.throughput.trained_tokens_per_second == pytest.approx(10_000 / 12.0)
    # start-up: wall - train (4 s) + the warm-up's time above two steady steps (10 - 2.4)
    assert est.throughput.startup_seconds == pytest.approx(4.0 + 10.0 - 2 * 1.2)
    assert est.train_seconds == pytest.approx(1_000_000 / (10_000 / 12.0) + 11.6)
    assert "mean of 10 steps after 2 warm-up steps" in est.time_basis
    # the whole-run mean would have said 1000 * 12 / 20 = 600 tokens/s: 1.39x too slow


def test_checkpoint_pauses_stay_in_the_steady_rate(tmp_path: Path) -> None:
    # every 5th steady step also wrote a checkpoint for 2 s: the full run pays that too
    secs = [1.0, 1.0] + [1.0, 1.0, 1.0, 1.0, 3.0] * 2
    run = _real_run(tmp_path / "run", secs, checkpoint_s={7: 2.0, 12: 2.0})
    rate = estimate(
        SHAPE, EstimateRequest(tokens=TOKENS, precision="fp32", profile=load_measured(run))
    ).throughput
    assert rate.trained_tokens_per_second == pytest.approx(1000 / 1.4)
    assert "pauses included" in rate.basis


def test_a_profile_json_uses_its_mean_step(tmp_path: Path) -> None:
    p = tmp_path / "profile.json"
    prof = {"tokens_per_second": 500.0, "step_seconds": [1.0, 1.0, 1.0, 5.0], "warmup": 2,
            "tokens_per_step": 1000, "phases": {"checkpoint": 0.0}, "device": "cpu"}  # fmt: skip
    p.write_text(json.dumps(prof))
    rate = estimate(
        SHAPE, EstimateRequest(tokens=TOKENS, precision="fp32", profile=load_measured(p))
    ).throughput
    assert rate.trained_tokens_per_second == pytest.approx(1000.0 / 2.0)  # the 5 s step counts
    assert rate.startup_seconds == 0.0
