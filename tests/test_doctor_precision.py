"""The doctor resolves `--precision auto` on a CPU as `pitstop train` does: from the same
measurement at the model's matmul shapes, shared through one cache entry, and never by
timing this machine for another one (a target, a pretended device)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

import pitstop.measure.peak as peak
from pitstop.advise.rules import Context
from pitstop.advise.setup import from_run_config
from pitstop.core.config import RunConfig
from pitstop.probe import DeviceInfo, PrecisionSpeed
from pitstop.train.precision_record import cpu_precision_speed

# `pitstop.advise.doctor` the attribute is the function; the module is what is patched here
doctor_mod = importlib.import_module("pitstop.advise.doctor")
BF16_CPU = DeviceInfo(type="cpu", name="a CPU with avx512_bf16", bf16=True, cpu_count=2)


@pytest.fixture()
def timings(monkeypatch):
    """measure_precision_speed replaced by given (fp32 s, bf16 s); counts its calls."""
    calls: list[tuple] = []
    result = {"value": (1.0, 0.4)}

    def fake(shapes):
        calls.append(shapes)
        return result["value"]

    monkeypatch.setattr(peak, "measure_precision_speed", fake)
    return calls, result


@pytest.fixture()
def this_machine(monkeypatch):
    """The environment probe reports a CPU with native bf16 (whatever this one has)."""

    def probe(**_kw):
        return {"device": BF16_CPU.to_dict()}

    monkeypatch.setattr(doctor_mod, "probe_environment", probe)


def _cfg(tiny_model_dir: Path, cache: Path) -> RunConfig:
    return RunConfig(model=str(tiny_model_dir), max_seq_len=64, cache_dir=str(cache))


def test_auto_is_what_train_would_choose_and_train_reuses_the_measurement(
    tiny_model_dir, tmp_path, timings, this_machine
):
    calls, _ = timings
    cfg = _cfg(tiny_model_dir, tmp_path / "cache")
    report = doctor_mod.doctor(config=cfg, compile_check=False, disk_check=False)
    prec = report["setup"]["precision"]
    assert prec["value"] == "bf16", prec
    assert "2.50x" in prec["reason"] and "measured on this CPU" in prec["reason"]
    assert len(calls) == 1
    # pitstop train, on the same machine and config, reads the doctor's measurement
    reused = cpu_precision_speed(cfg, BF16_CPU)
    assert len(calls) == 1 and reused is not None
    assert reused.gain == pytest.approx(2.5) and reused.source.startswith("reused")


def test_a_small_gain_keeps_fp32_and_says_why(tiny_model_dir, tmp_path, timings, this_machine):
    calls, result = timings
    result["value"] = (1.0, 0.95)
    cfg = _cfg(tiny_model_dir, tmp_path / "cache")
    prec = doctor_mod.doctor(config=cfg, compile_check=False, disk_check=False)["setup"][
        "precision"
    ]
    assert prec["value"] == "fp32" and "not measured 1.30x faster" in prec["reason"], prec
    assert len(calls) == 1


def test_another_machine_is_never_timed_here(tiny_model_dir, tmp_path, monkeypatch):
    def no_timing(shapes):
        raise AssertionError("the doctor timed this CPU for a device it is not auditing")

    monkeypatch.setattr(peak, "measure_precision_speed", no_timing)
    cfg = _cfg(tiny_model_dir, tmp_path / "cache")
    report = doctor_mod.doctor(
        config=cfg, device=BF16_CPU, environment={}, compile_check=False, disk_check=False
    )
    prec = report["setup"]["precision"]
    assert prec["value"] == "fp32" and "not measured" in prec["reason"], prec


def test_a_configured_precision_is_kept_as_configured(tiny_model_dir, tmp_path, this_machine):
    cfg = RunConfig(model=str(tiny_model_dir), max_seq_len=64, precision="fp32")
    prec = doctor_mod.doctor(config=cfg, compile_check=False, disk_check=False)["setup"][
        "precision"
    ]
    assert prec == {"value": "fp32", "reason": "as configured"}


def test_the_rules_price_the_measured_precision() -> None:
    setup = from_run_config(RunConfig(max_seq_len=64))
    measured = PrecisionSpeed(1.0, 0.4, ((64, 64, 64),), "measured on this CPU")
    assert Context(setup=setup, device=BF16_CPU).precision == "fp32"
    assert Context(setup=setup, device=BF16_CPU, measured_precision=measured).precision == "bf16"
