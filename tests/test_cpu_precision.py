"""Precision on the CPU is measured, not assumed (issue 23).

bf16 autocast is a candidate only where the CPU has native bf16 (its flags), is chosen only
when a measurement at the model's shapes says it is faster, and the choice carries its
measurement into the banner and summary.json. `--precision fp32` stays the way out.
"""

from __future__ import annotations

import json
import math

import pytest

from pitstop import probe
from pitstop.core.errors import ConfigError
from pitstop.measure import peak
from pitstop.probe import DeviceInfo, PrecisionSpeed, choose_precision

PLAIN_CPU = DeviceInfo(type="cpu", name="cpu without bf16", cpu_count=2)
BF16_CPU = DeviceInfo(type="cpu", name="cpu with avx512_bf16", bf16=True, cpu_count=2)
SHAPES = ((64, 64, 128),)


def test_the_cpu_flags_decide_whether_bf16_is_a_candidate():
    assert probe.cpu_has_bf16(frozenset({"avx2", "avx512f", "avx512_bf16"}))
    assert probe.cpu_has_bf16(frozenset({"amx_bf16", "amx_tile"}))
    assert not probe.cpu_has_bf16(frozenset({"avx2", "avx512f", "avx512_vnni"}))
    assert not probe.cpu_bf16_candidate("auto", PLAIN_CPU)
    assert probe.cpu_bf16_candidate("auto", BF16_CPU)
    assert not probe.cpu_bf16_candidate("fp32", BF16_CPU)


def test_auto_chooses_bf16_only_when_measured_faster():
    fast = PrecisionSpeed(0.030, 0.012, SHAPES, "measured on this CPU")
    slow = PrecisionSpeed(0.030, 0.029, SHAPES, "measured on this CPU")
    c = choose_precision("auto", BF16_CPU, fast)
    assert c.value == "bf16"
    assert "30.0 ms in fp32 and 12.0 ms under bf16" in c.reason
    assert c.measured == fast.to_dict() and c.to_dict()["measured"]["bf16_speedup"] == 2.5
    c = choose_precision("auto", BF16_CPU, slow)
    assert c.value == "fp32" and c.measured is not None and "not measured" in c.reason
    # Unmeasured, and the way out, stay fp32; no bf16 instructions: fp32 whatever was timed.
    assert choose_precision("auto", BF16_CPU, None).value == "fp32"
    assert choose_precision("fp32", BF16_CPU, fast).value == "fp32"
    c = choose_precision("auto", PLAIN_CPU, fast)
    assert c.value == "fp32" and "without native bf16" in c.reason


def test_bf16_on_a_cpu_without_it_and_fp16_on_any_cpu_are_refused():
    with pytest.raises(ConfigError, match="avx512_bf16 or amx_bf16"):
        choose_precision("bf16", PLAIN_CPU)
    with pytest.raises(ConfigError, match="fp16 needs a CUDA GPU"):
        choose_precision("fp16", BF16_CPU)
    assert choose_precision("bf16", BF16_CPU).value == "bf16"


def test_the_precision_measurement_is_cached_by_shapes(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(peak, "measure_precision_speed", lambda s: calls.append(s) or (2.0, 1.0))
    a = peak.cpu_precision_speed(tmp_path, SHAPES)
    b = peak.cpu_precision_speed(tmp_path, SHAPES)
    assert (a.fp32_s, a.bf16_s) == (b.fp32_s, b.bf16_s) == (2.0, 1.0)
    assert a.source == "measured on this CPU" and b.source.startswith("reused")
    peak.cpu_precision_speed(tmp_path, ((128, 64, 128),))  # other shapes: measured again
    assert len(calls) == 2


def test_a_measurement_under_another_key_never_replaces_this_one(tmp_path, monkeypatch):
    """One file per key: a run with other shapes or another thread count (the reliability
    suite's in-process runs use the pytest process's threads) measuring in between must not
    evict this key's entry. It did with one file per kind, the next run measured again, and
    a precision near the threshold came out the other way (a resumed run no longer matched
    its reference in CI)."""
    import torch

    answers = iter([(2.0, 1.0), (1.0, 2.0), (1.0, 2.0)])
    monkeypatch.setattr(peak, "measure_precision_speed", lambda s: next(answers))
    first = peak.cpu_precision_speed(tmp_path, SHAPES)
    peak.cpu_precision_speed(tmp_path, ((128, 64, 128),))  # other shapes
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        peak.cpu_precision_speed(tmp_path, SHAPES)  # another thread count
    finally:
        torch.set_num_threads(threads)
    again = peak.cpu_precision_speed(tmp_path, SHAPES)
    assert again.source.startswith("reused") and (again.fp32_s, again.bf16_s) == (2.0, 1.0)
    assert (first.fp32_s, first.bf16_s) == (2.0, 1.0)
    assert len(list(tmp_path.glob("cpu_precision-*.json"))) == 3


def test_the_real_measurement_times_both_precisions():
    fp32_s, bf16_s = peak.measure_precision_speed(SHAPES)
    assert 0 < fp32_s < 1 and 0 < bf16_s < 1


def test_model_shapes_follow_the_config_and_stay_within_the_budget():
    small = peak.model_matmul_shapes({"hidden_size": 64, "intermediate_size": 128,
                                      "vocab_size": 300}, 64)  # fmt: skip
    assert small == ((64, 64, 128), (64, 64, 300))
    big = peak.model_matmul_shapes({"hidden_size": 4096, "intermediate_size": 14336,
                                    "vocab_size": 128256}, 4096)  # fmt: skip
    assert sum(6 * m * k * n for m, k, n in big) <= peak._PRECISION_FLOPS_BUDGET


def test_mfu_uses_the_peak_of_the_precision_in_use(tmp_path, monkeypatch):
    # A quiet measurement (the machine's load while measuring is its own test:
    # test_watch_any_program.py): a busy one would be measured again, not reused.
    monkeypatch.setattr(peak, "measure_cpu_peak_quietly", lambda precision="fp32": {
        "flops": {"fp32": 1e11, "bf16": 3e11}[precision], "other_cores": 0.0, "cores": 2,
        "busy": False})  # fmt: skip
    assert peak.device_peak(BF16_CPU, "bf16", False, tmp_path)[0] == 3e11
    assert peak.device_peak(BF16_CPU, "fp32", False, tmp_path)[0] == 1e11
    flops, source = peak.device_peak(BF16_CPU, "bf16", False, tmp_path)
    assert flops == 3e11 and "bf16" in source and "cached" in source


def _run(tiny_model_dir, store, out, **over):
    from _train_util import train_config

    import pitstop.train

    s = pitstop.train.run(train_config(tiny_model_dir, store, out, **over))
    return s, [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_auto_on_a_cpu_without_bf16_flags_keeps_fp32(tiny_model_dir, store, tmp_path, monkeypatch):
    monkeypatch.setattr(probe, "cpu_flags", lambda: frozenset({"sse4_2", "avx2", "avx512f"}))
    monkeypatch.setattr(peak, "measure_precision_speed", lambda s: pytest.fail("measured"))
    s, _ = _run(tiny_model_dir, store, tmp_path / "out", precision="auto", max_steps=2)
    assert s["choices"]["precision"]["value"] == "fp32"
    assert "without native bf16" in s["choices"]["precision"]["reason"]


def test_auto_records_its_measurement_and_bf16_autocast_trains_close_to_fp32(
    tiny_model_dir, store, tmp_path, monkeypatch
):
    monkeypatch.setattr(probe, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    # The tiny model is too small for bf16 to pay on a real CPU; pretend it measured faster.
    monkeypatch.setattr(peak, "measure_precision_speed", lambda s: (0.02, 0.01))
    s, bf16 = _run(tiny_model_dir, store, tmp_path / "bf16", precision="auto")
    choice = s["choices"]["precision"]
    assert choice["value"] == "bf16"
    assert choice["measured"]["fp32_seconds"] == 0.02 and choice["measured"]["bf16_speedup"] == 2
    assert "measured faster" in choice["reason"]
    assert list((tmp_path / "cache").glob("cpu_precision-*.json"))
    _, fp32 = _run(tiny_model_dir, store, tmp_path / "fp32", precision="fp32")
    assert all(math.isfinite(x) for x in bf16)
    assert bf16 != fp32  # it really ran in bf16
    assert bf16 == pytest.approx(fp32, abs=0.05)


def test_a_resumed_run_keeps_the_measured_precision_and_continues_exactly(
    tiny_model_dir, store, tmp_path, monkeypatch
):
    """The precision is recorded in choices.json before step 1 and --resume takes it from
    there: a cleared cache, or a machine that now measures fp32 faster, cannot change the
    math halfway, and the continuation is bit-identical to a run never stopped."""
    from _train_util import stopped_run

    monkeypatch.setattr(probe, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    monkeypatch.setattr(peak, "measure_precision_speed", lambda s: (0.02, 0.01))
    kw = {"precision": "auto", "max_steps": 4, "save_steps": 2}
    _, whole = _run(tiny_model_dir, store, tmp_path / "whole", **kw)

    out = tmp_path / "cut"
    record = stopped_run(tiny_model_dir, store, out, monkeypatch, **kw)
    assert record is not None and record.values["precision"] == "bf16"
    assert record.measurements["precision"]["bf16_speedup"] == 2

    for f in (tmp_path / "cache").glob("cpu_precision-*.json"):
        f.unlink()  # the cache is gone, and now
    monkeypatch.setattr(peak, "measure_precision_speed", lambda s: (0.01, 0.02))  # fp32 wins
    s, resumed = _run(tiny_model_dir, store, out, resume=True, **kw)
    assert s["choices"]["precision"]["value"] == "bf16"
    assert "kept from this run" in s["choices"]["precision"]["reason"]
    assert resumed == whole
