"""`estimate --from-profile` keeps what was measured (issue 36, item 4).

A host-bound loop (0.2 s of tokenizing per item in `__getitem__`, batch 1, no workers) was
estimated at 6.2 s for 200 epochs that take ~20 minutes on any GPU: on another device
only the device work (forward, backward, optimizer) scales, the host time is the run's
own. The run's step (trained tokens per step, rows, row length, accumulation) was
replaced by one micro-batch of 1,024 positions; and --model/--tokens were required
although the run names its model. Runs are written here as `pitstop profile` writes
them (summary.json + metrics.jsonl), so the tests are fast; one slow test profiles a
real loop.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pitstop import cli
from pitstop.core.errors import ConfigError
from pitstop.report.estimate import format_estimate
from pitstop.report.planned import estimate_planned_run

ROOT = Path(__file__).resolve().parents[1]
SMALL_LLAMA = {
    "model_type": "llama", "hidden_size": 256, "intermediate_size": 688,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
    "vocab_size": 8000,
}  # fmt: skip
ITEMS = 25  # items per epoch of the tokenizing loop
WAIT_S = 0.2  # tokenizing per item, in __getitem__, with num_workers=0
COMPUTE = {"forward": 0.01, "backward": 0.015, "optimizer": 0.005}  # 0.03 s on the CPU


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(SMALL_LLAMA))
    return d


def loop_run(
    dest: Path,
    *,
    steps: int = 40,
    rows: int = 1,
    accumulation: int = 1,
    positions: int = 256,
    wait_s: float = WAIT_S,
    other_s: float = 0.002,
    device: Any = None,
    mfu: float | None = None,
    command: list[str] | None = None,
    config: dict[str, Any] | None = None,
) -> Path:
    """A plain loop's run directory as `pitstop profile -- python loop.py` writes it: every
    step `rows × accumulation` rows of `positions` positions (one fewer trained: the
    shifted labels), `wait_s` of data wait per row, the CPU compute of COMPUTE per micro-batch."""
    dest.mkdir(parents=True)
    step_rows = rows * accumulation
    trained = step_rows * (positions - 1)
    phases = {"data_wait": wait_s * step_rows, "host_to_device": 0.0, "checkpoint": 0.0,
              "eval": 0.0, "logging": 0.0, "other": other_s,
              **{k: v * accumulation for k, v in COMPUTE.items()}}  # fmt: skip
    step_s = sum(phases.values())
    lines = []
    for i in range(1, steps + 1):
        lines.append({"step": i, "warmup": i == 1, "trained_tokens": trained * i,
                      "seen_tokens": step_rows * positions * i,
                      "padded_tokens": step_rows * positions * i,
                      "step_trained_tokens": trained, "step_rows": step_rows,
                      "step_seconds": step_s, **{f"{k}_s": v for k, v in phases.items()}})  # fmt: skip
    (dest / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    summary = {
        "schema_version": 1, "status": "completed", "source": "script",
        "optimizer_steps": steps, "trained_tokens": trained * steps,
        "seen_tokens": step_rows * positions * steps,
        "padded_tokens": step_rows * positions * steps, "rows": step_rows * steps,
        "train_seconds": step_s * steps, "wall_seconds": step_s * steps + 3.0,
        "tokens_per_second": trained / step_s, "trained_tokens_per_step": float(trained),
        "mfu": mfu, "time_breakdown": {k: v * steps for k, v in phases.items()},
        "device": device or {"type": "cpu", "name": "AMD EPYC"},
        "choices": {"precision": {"value": "fp32", "reason": "observed"}},
        "config": {"gradient_checkpointing": False, "gradient_accumulation_steps": accumulation,
                   "per_device_train_batch_size": rows, "dataloader_num_workers": 0,
                   **(config or {})},
        "command": command or [sys.executable, "loop.py"], "command_cwd": str(dest.parent),
    }  # fmt: skip
    (dest / "summary.json").write_text(json.dumps(summary))
    return dest


def test_a_host_bound_loop_keeps_its_host_time_on_a_gpu(tmp_path: Path, model_dir: Path) -> None:
    """The issue's loop: 200 epochs of 25 items, 0.2 s of tokenizing each: ~17 minutes of
    host time whatever the GPU, not 6.2 s."""
    run = loop_run(tmp_path / "run")
    tokens = ITEMS * 255  # trained tokens per epoch: 255 per step, one item per step
    kw: dict[str, Any] = dict(model=str(model_dir), tokens=tokens, epochs=200,
                              from_profile=str(run))  # fmt: skip
    est = estimate_planned_run(gpu="RTX 4090", **kw)
    steps = 200 * ITEMS
    assert est.optimizer_steps == steps  # the run's 255 tokens per step, not 1,024
    assert est.split is not None
    host = steps * (WAIT_S + 0.002)  # data wait and 'other', as measured
    assert est.split["host_seconds"] == pytest.approx(host, rel=1e-3)
    assert est.train_seconds == pytest.approx(host + est.split["device_seconds"] + 3.0, rel=1e-3)
    assert est.train_seconds > 1000  # not seconds: the host time does not scale
    # The device work did scale: forward/backward/optimizer took 0.03 s per step on the CPU.
    assert est.split["device_seconds"] < steps * 0.03
    assert est.memory is not None
    assert (est.memory.micro_batch_size, est.memory.seq_len) == (1, 256)
    text = format_estimate(est)
    assert "host time kept as measured: 0.202 s per step" in text
    assert "data_wait 0.2 s" in text and f"× {steps:,} steps" in text
    assert "device time (forward, backward, optimizer) scaled to RTX 4090" in text
    assert "255 trained tokens per step (1 row(s) × 256 positions" in text
    # Without --gpu the measured rate holds the same host time, and the same step count.
    same = estimate_planned_run(**kw)
    assert same.optimizer_steps == steps and same.split is None
    assert same.train_seconds == pytest.approx(steps * 0.232 + 3.0, rel=1e-3)
    assert est.train_seconds <= same.train_seconds  # a faster device only shortens compute


def test_an_accumulation_loop_keeps_its_step(tmp_path: Path, model_dir: Path) -> None:
    """Batch 2 × accumulation 4 of 512 positions: 4,088 trained tokens per step, not one
    micro-batch of 2 × 1,024 (twice the steps, and twice the checkpoints)."""
    run = loop_run(tmp_path / "run", rows=2, accumulation=4, positions=512, wait_s=0.01)
    per_step = 2 * 4 * 511
    kw: dict[str, Any] = dict(model=str(model_dir), tokens=per_step * 245,
                              from_profile=str(run), save_steps=10)  # fmt: skip
    for gpu in ("RTX 4090", None):
        est = estimate_planned_run(gpu=gpu, **kw)
        assert est.optimizer_steps == 245, gpu
        assert est.checkpoints is not None and est.checkpoints["saves"] == 24
        assert est.memory is not None
        assert (est.memory.micro_batch_size, est.memory.seq_len) == (2, 512)
        kept = next(a for a in est.assumptions if a.startswith("kept from the measured run"))
        assert "accumulation of 4 micro-batch(es)" in kept and "rows of 512 positions" in kept
    # A flag that changes the micro-batch scales the measured step, keeping the accumulation.
    wider = estimate_planned_run(gpu="RTX 4090", micro_batch_size=4, **kw)
    assert wider.optimizer_steps == -(-245 // 2)
    assert "micro-batch rows 2 → 4" in wider.steps_basis


def test_a_gpu_runs_mfu_counts_its_device_phases_only(tmp_path: Path, model_dir: Path) -> None:
    """A GPU run's MFU is over its whole step; with its host time added separately, the
    device work runs at the MFU of the device phases (else host time is counted twice)."""
    run = loop_run(tmp_path / "run", device="NVIDIA A100-SXM4-80GB", mfu=0.1)
    est = estimate_planned_run(model=str(model_dir), tokens=10**6, from_profile=str(run),
                               gpu="H100")  # fmt: skip
    device_share = 0.03 / 0.232
    assert est.throughput.mfu == pytest.approx(0.1 / device_share)
    assert "over the device phases" in est.time_basis
    assert est.split is not None and est.split["host_seconds"] > 0


def test_the_model_and_tokens_default_to_the_runs(
    tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run's summary names the model (a plain loop: its command's model directory;
    `pitstop train`: config.model) and its trained tokens: no --model/--tokens needed."""
    run = loop_run(tmp_path / "run", command=[sys.executable, "loop.py", "model", "--sleep", "0.2"])
    est = estimate_planned_run(from_profile=str(run), gpu="RTX 4090")
    assert est.tokens.trained_tokens == 40 * 255 and est.optimizer_steps == 40
    assert "the measured run's own 10,200 trained tokens" in est.tokens.basis
    kept = next(a for a in est.assumptions if a.startswith("kept from the measured run"))
    assert f"model {model_dir}" in kept
    trained = loop_run(tmp_path / "trained", config={"model": str(model_dir)})
    assert estimate_planned_run(from_profile=str(trained)).optimizer_steps == 40
    # Through the command line, the same defaults.
    assert cli.main(["estimate", "--from-profile", str(run), "--gpu", "RTX 4090"]) == 0
    assert "host time kept as measured" in capsys.readouterr().out
    # A run that names no model: one clear line, naming the flag.
    bare = loop_run(tmp_path / "bare")
    with pytest.raises(ConfigError, match="names no model directory; give --model DIR"):
        estimate_planned_run(from_profile=str(bare), gpu="RTX 4090")
    with pytest.raises(ConfigError, match="the run's model is not here"):
        estimate_planned_run(from_profile=str(loop_run(tmp_path / "gone",
                             config={"model": str(tmp_path / "nowhere")})))  # fmt: skip


def test_a_profile_without_phases_says_its_host_time_is_unknown(
    tmp_path: Path, model_dir: Path
) -> None:
    p = tmp_path / "profile.json"
    prof = {"schema": "pitstop.profile/1", "tokens_per_second": 500.0, "tokens_per_step": 255,
            "step_seconds": [0.51] * 4, "device": "cpu"}  # fmt: skip
    p.write_text(json.dumps(prof))
    est = estimate_planned_run(model=str(model_dir), tokens=255 * 100, from_profile=str(p),
                               gpu="RTX 4090")  # fmt: skip
    assert est.split is None and est.optimizer_steps == 100
    assert any("host time" in a and "not known" in a for a in est.assumptions)
    # `pitstop profile --output FILE` records its config: its model is the default.
    p.write_text(json.dumps({**prof, "config": {"model": str(model_dir)}}))
    est = estimate_planned_run(tokens=255 * 100, from_profile=str(p), gpu="RTX 4090")
    kept = next(a for a in est.assumptions if a.startswith("kept from the measured run"))
    assert f"model {model_dir}" in kept


@pytest.mark.slow
def test_a_profiled_sleeping_loop_keeps_its_sleep(tmp_path: Path) -> None:
    """End to end: `pitstop profile` of a real loop that sleeps 0.1 s per item (2 per
    step), then `estimate --from-profile RUN --gpu` with no --model/--tokens: the same run
    on an RTX 4090 still waits for its loader."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    loop = [sys.executable, str(ROOT / "tests" / "_linear_loop.py"), "--steps", "5"]
    res = subprocess.run(
        [sys.executable, "-m", "pitstop", "profile", "--output", "run", "--", *loop,
         "--sleep", "0.1"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    est = estimate_planned_run(from_profile=str(tmp_path / "run"), params=1e6, gpu="RTX 4090")
    assert est.optimizer_steps == 5 and est.split is not None
    assert est.split["host_seconds_per_step"] >= 2 * 0.1 * 0.95
    assert est.train_seconds >= 5 * 2 * 0.1 * 0.95
