"""End-to-end training runs on the tiny Llama (CPU): outputs, resume, crashes, NaN, signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pitstop.core.errors import ConfigError
from pitstop.core.run_record import RunSummary

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def _cfg(model, store, out, **over):
    from _train_util import train_config

    return train_config(model, store, out, **over)


def _metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "final" / "model.safetensors")


def test_run_writes_the_contract_outputs(tiny_model_dir, store, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from pitstop.train.trainer import Trainer

    out = tmp_path / "out"
    tr = Trainer.from_config(_cfg(tiny_model_dir, store, out, save_steps=2, save_total_limit=2,
                      report_to=["tensorboard"]))  # fmt: skip
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    summary = tr.fit()
    # The loop's handlers (finish the step, save) are the run's only: restored by its `with`.
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers
    assert isinstance(summary, RunSummary) and summary.status == "completed"
    s = summary.to_json()
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["trained_tokens"] == s["trained_tokens"]
    for key in ("trained_tokens", "seen_tokens", "padded_tokens", "optimizer_steps", "train_seconds",
                "wall_seconds", "tokens_per_second", "mfu", "peak_memory_bytes", "final_loss",
                "time_breakdown", "device", "choices", "checkpoint_pause_seconds", "skipped_steps",
                "packing_efficiency", "padding_waste", "config"):  # fmt: skip
        assert key in s, key
    assert 0 < s["trained_tokens"] <= s["seen_tokens"] <= s["padded_tokens"]
    assert s["tokens_per_second"] == pytest.approx(s["trained_tokens"] / s["train_seconds"])
    assert s["optimizer_steps"] == 6 and s["skipped_steps"] == 0
    assert s["wall_seconds"] >= s["train_seconds"] > 0
    assert 0 < s["mfu"] < 1 and s["peak_memory_bytes"] > 0
    for name in ("precision", "attention", "compile", "batching", "loader_workers", "optimizer"):
        assert s["choices"][name]["reason"], name
    # metrics.jsonl: one line per optimizer step, counters consistent with the summary
    lines = _metrics(out)
    assert [r["step"] for r in lines] == list(range(1, 7))
    assert lines[-1]["trained_tokens"] == s["trained_tokens"]
    assert all(0 < r["mfu"] < 1 for r in lines) and lines[-1]["peak_memory_gib"] > 0
    assert s["machine"]["cpu_cores"] >= 1  # the load its figures were measured under
    assert lines[-1]["loss"] == pytest.approx(s["final_loss"])
    for r in lines:  # the phases explain the step time
        phases = sum(r[f"{p}_s"] for p in s["time_breakdown"])
        assert phases == pytest.approx(r["step_seconds"], rel=0.03)
    # checkpoints: the newest two, plus TensorBoard events
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-4", "step-6"]
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    # final/ loads with from_pretrained and gives the in-memory model's logits
    loaded = AutoModelForCausalLM.from_pretrained(out / "final").eval()
    ids = torch.randint(3, 4000, (2, 16), generator=torch.Generator().manual_seed(1))
    tr.run.model.eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, tr.run.model(ids).logits)
    assert (out / "final" / "tokenizer.json").is_file()
    # the banner names every choice with its reason
    err = capsys.readouterr().err
    for name, c in s["choices"].items():
        assert name in err and c["reason"] in err, name


@pytest.mark.parametrize("compile_", ["off", "on"])
def test_resume_is_bit_identical(tiny_model_dir, store, tmp_path, monkeypatch, compile_):
    """Eager: bit for bit. Compiled (`--compile on`, sdpa_docs as one op): every life
    compiles the same graphs, so the resumed run continues the uninterrupted one; the
    comparison allows float rounding: a kernel's reduction order may differ between the two
    compiles (measured: the losses within 1e-6, one weight in 262,144 off by 1.7e-7)."""
    from pitstop.train import run
    from pitstop.train.trainer import RunInterrupted

    ref = tmp_path / "ref"
    s_ref = run(_cfg(tiny_model_dir, store, ref, compile=compile_))
    out = tmp_path / "cut"
    monkeypatch.setenv("PITSTOP_TEST_STOP_AT_STEP", "3")  # behaves like SIGTERM after step 3
    with pytest.raises(RunInterrupted) as e:
        run(_cfg(tiny_model_dir, store, out, compile=compile_))
    assert e.value.exit_code == 143 and "--resume" in str(e.value)
    assert (out / "checkpoints" / "step-3" / "COMPLETE.json").is_file()
    monkeypatch.delenv("PITSTOP_TEST_STOP_AT_STEP")
    with pytest.raises(ConfigError):
        run(_cfg(tiny_model_dir, store, out, compile=compile_))  # no --resume: refused
    s = run(_cfg(tiny_model_dir, store, out, resume=True, compile=compile_))
    assert s["resumed_from"].endswith("step-3")
    assert s["choices"]["compile"]["value"] is (compile_ == "on")
    a, b = _metrics(ref), _metrics(out)
    assert [r["step"] for r in b] == list(range(1, 7))
    tol = {"rel": 0, "abs": 0} if compile_ == "off" else {"rel": 1e-6, "abs": 1e-7}
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a], **tol)
    assert [r["grad_norm"] for r in b] == pytest.approx([r["grad_norm"] for r in a], **tol)
    wa, wb = _weights(ref), _weights(out)
    wtol = {"rtol": 0, "atol": 0} if compile_ == "off" else {"rtol": 1e-5, "atol": 1e-6}
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], **wtol)
    for key in ("trained_tokens", "seen_tokens", "padded_tokens", "optimizer_steps"):
        assert s[key] == s_ref[key], key
    assert s["final_loss"] == pytest.approx(s_ref["final_loss"], **tol)  # CI: 1.2e-7 apart


def _train_cmd(model, store, out, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pitstop", "train", "--model", str(model), "--data", str(store),
            "--output", str(out), "--max-seq-len", "64", "--tokens-per-step", "256",
            "--micro-batch-size", "2", "--batching", "pack", "--max-steps", "8", "--log-steps", "2",
            "--lr", "1e-3", "--report-to", "none", "--compile", "off", "--save-steps", "2",
            "--cache-dir", str(out.parent / "cache"), *extra]  # fmt: skip


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **extra}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_sigterm_saves_and_prints_the_resume_command(tiny_model_dir, store, tmp_path):
    out = tmp_path / "out"
    # The run holds inside its step-2 checkpoint write until the gate file exists: the
    # signal lands in the middle of the run however slow the machine.
    gate = tmp_path / "gate"
    proc = subprocess.Popen(_train_cmd(tiny_model_dir, store, out), stdout=subprocess.PIPE,
                            env=_env(PITSTOP_TEST_HOLD_AT="ckpt-write:2", PITSTOP_TEST_HOLD_GATE=str(gate)),
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.time() + 240
    while not (tmp_path / "gate.held").exists():
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    gate.touch()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "--resume" in err and "SIGTERM" in err
    from pitstop.train.checkpoint import latest_checkpoint

    step = int(latest_checkpoint(out / "checkpoints").name.split("-")[1])
    assert 2 < step < 8
    assert json.loads((out / "summary.json").read_text())["status"] == "interrupted"


def test_nan_steps_are_skipped_then_the_run_stops(tiny_model_dir, store, tmp_path, monkeypatch):
    from pitstop.train import run
    from pitstop.train.trainer import TrainingDiverged

    monkeypatch.setenv("PITSTOP_TEST_NAN_STEPS", "3")
    out = tmp_path / "one"
    s = run(_cfg(tiny_model_dir, store, out, max_bad_steps=2, save_steps=2))
    assert s["skipped_steps"] == 1 and s["optimizer_steps"] == 6
    lines = _metrics(out)
    assert lines[2]["skipped"] is True and lines[2]["loss"] is None
    assert all(r["loss"] is not None for i, r in enumerate(lines) if i != 2)
    assert all(torch.isfinite(w).all() for w in _weights(out).values())

    monkeypatch.setenv("PITSTOP_TEST_NAN_STEPS", "3,4,5")
    out = tmp_path / "many"
    with pytest.raises(
        TrainingDiverged, match=r"step 4: 2 optimizer steps in a row.*learning rate"
    ):
        run(_cfg(tiny_model_dir, store, out, max_bad_steps=2, save_steps=2))
    from pitstop.train.checkpoint import latest_checkpoint

    assert latest_checkpoint(out / "checkpoints").name == "step-2"
    assert json.loads((out / "summary.json").read_text())["status"] == "diverged"


def test_a_failed_checkpoint_write_stops_cleanly(tiny_model_dir, store, tmp_path, monkeypatch):
    from pitstop.train import run
    from pitstop.train.checkpoint import CheckpointError, latest_checkpoint

    monkeypatch.setenv("PITSTOP_TEST_CKPT_FAIL", "4")
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=r"No space left.*step-2"):
        run(_cfg(tiny_model_dir, store, out, save_steps=2))
    assert latest_checkpoint(out / "checkpoints").name == "step-2"
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]


def test_lora_run_saves_a_peft_adapter(tiny_model_dir, store, tmp_path):
    import peft
    from transformers import AutoModelForCausalLM

    from pitstop.train import run

    out = tmp_path / "out"
    s = run(_cfg(tiny_model_dir, store, out, lora_r=4, max_steps=2))
    assert "lora" in s["choices"]
    assert (out / "final" / "adapter_config.json").is_file()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = peft.PeftModel.from_pretrained(base, out / "final")
    assert any("lora_" in n for n, _ in model.named_parameters())


def test_a_measurement_run_keeps_no_final_model_and_says_so(tiny_model_dir, store, tmp_path):
    """`Trainer(save_final=False)` (profile, tune, benchmarks) writes no final/: its summary
    names none and its last line does not point at one."""
    from pitstop.train.summary import result_line
    from pitstop.train.trainer import Trainer

    out = tmp_path / "out"
    summary = Trainer.from_config(_cfg(tiny_model_dir, store, out), save_final=False).fit()
    assert summary.status == "completed" and not (out / "final").exists()
    assert summary.final_model is None
    assert json.loads((out / "summary.json").read_text())["final_model"] is None
    assert "no final model kept" in result_line(summary)
