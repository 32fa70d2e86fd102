"""The bottleneck verdict on constructed profiles, the profile schema, and the sampler."""

from __future__ import annotations

import json
import time

import pytest

from pitstop.core.errors import DataError
from pitstop.measure import verdict as V
from pitstop.measure.sampler import NullSampler, Sampler, make_sampler
from pitstop.measure.schema import load_profile, make_profile
from pitstop.measure.timeline import PHASES


def profile(data_share: float = 0.0, steps: int = 10, step_s: float = 0.2, **shares: float) -> dict:
    """A profile whose phases take the given shares of step time; forward+backward the rest."""
    shares = {"data_wait": data_share, **shares}
    per = []
    for _ in range(steps):
        rec = {k: v * step_s for k, v in shares.items()}
        rest = step_s - sum(rec.values())
        rec["forward"] = rest / 3
        rec["backward"] = 2 * rest / 3
        per.append(rec)
    return make_profile(per, [step_s] * steps, warmup=1, source="pitstop", trained_tokens=1e5)


def test_profile_schema_phases_add_up() -> None:
    p = profile(0.1, optimizer=0.1)
    assert set(p["phases"]) == set(PHASES)
    assert sum(p["phases"].values()) == pytest.approx(sum(p["step_seconds"]))
    assert p["steps"] == 10 and p["warmup"] == 1 and p["source"] == "pitstop"
    assert p["tokens_per_second"] == pytest.approx(1e5 / 2.0)


@pytest.mark.parametrize(
    ("share", "severity"),
    [(0.049, None), (0.05, "moderate"), (0.19, "moderate"), (0.20, "severe"), (0.5, "severe")],
)
def test_input_bound_thresholds(share: float, severity: str | None) -> None:
    v = V.verdict(profile(share))
    if severity is None:
        assert v.kind == "compute-bound"
    else:
        assert v.kind == "input-bound" and v.severity == severity
        assert v.evidence["data_wait_share"] == pytest.approx(share, abs=1e-4)


def test_ordinary_compute_heavy_profile_is_compute_bound() -> None:
    p = profile(0.01, optimizer=0.08, other=0.02)
    p["mfu"] = 0.41
    v = V.verdict(p)
    assert v.kind == "compute-bound" and v.severity == "ok"
    assert v.evidence["compute_share"] == pytest.approx(0.89, abs=1e-3)
    assert "41.0% MFU" in v.summary


@pytest.mark.parametrize(
    ("shares", "kind"),
    [
        ({"checkpoint": 0.25}, "checkpoint-bound"),
        ({"optimizer": 0.3}, "optimizer-bound"),
        ({"other": 0.2, "logging": 0.05}, "sync-bound"),
    ],
)
def test_other_verdicts(shares: dict, kind: str) -> None:
    v = V.verdict(profile(0.0, **shares))
    assert v.kind == kind


def test_worst_first_and_also() -> None:
    v = V.verdict(profile(0.25, optimizer=0.3))
    assert v.kind == "input-bound" and v.severity == "severe"
    assert [a.kind for a in v.also] == ["optimizer-bound"]


def test_erratic_steps_without_host_time_are_a_noisy_machine() -> None:
    """Erratic steps that host time does not explain: another process, not syncs (issue 24)."""
    p = profile(0.0, steps=10)
    p["step_seconds"] = [0.1] * 9 + [1.0]
    v = V.verdict(p)
    assert v.kind == "noisy-machine"
    assert v.evidence["step_spread"]["max_over_median"] == pytest.approx(10.0)
    assert "sync" not in v.summary and "no configuration change" in v.summary


def test_noisy_machine_comes_first() -> None:
    """A noisy machine's other shares are suspect: the verdict defers to noisy-machine."""
    p = profile(0.3, steps=10)
    p["step_seconds"] = [0.1] * 9 + [1.0]
    p["machine"] = {"load_average_1m": 4.0, "cpu_cores": 2}
    v = V.verdict(p)
    assert v.kind == "noisy-machine" and v.evidence["busy"] is True
    assert [a.kind for a in v.also] == ["input-bound"]
    assert "sync-bound" not in [a.kind for a in v.also]


def test_sync_bound_on_a_cpu_names_no_device_syncs() -> None:
    p = profile(0.0, other=0.2, logging=0.05)
    p["device"] = {"type": "cpu", "name": "AMD EPYC"}
    v = V.verdict(p)
    assert v.kind == "sync-bound" and "host-device" not in v.summary and "CPU" in v.summary
    p["device"] = {"type": "cuda", "name": "NVIDIA H100 80GB HBM3"}
    assert "host-device syncs" in V.verdict(p).summary


def test_load_profile_errors(tmp_path) -> None:
    bad = tmp_path / "p.json"
    bad.write_text("{not json")
    with pytest.raises(DataError, match="not valid JSON"):
        load_profile(bad)
    bad.write_text(json.dumps({"steps": 3}))
    with pytest.raises(DataError, match="missing key 'phases'"):
        load_profile(bad)
    good = tmp_path / "g.json"
    good.write_text(json.dumps(profile(0.1)))
    assert load_profile(good)["steps"] == 10


def test_sampler_cpu_path() -> None:
    with Sampler(interval_s=0.02) as s:
        t = time.perf_counter()
        # Until a few samples are in (not a fixed time: a busy CI box delays the thread).
        while s.summary()["samples"] < 3 and time.perf_counter() - t < 10:
            sum(i * i for i in range(1000))  # keep a core busy
    summ = s.summary()
    assert summ["samples"] >= 2
    assert summ["rss_bytes"]["max"] > 10 * 2**20
    assert 0 <= summ["cpu_percent"]["mean"] <= 100
    assert summ["process_cpu_percent"]["max"] > 0
    assert "gpu_util_percent" not in summ  # no GPU asked for


def test_sampler_without_gpu_reports_why() -> None:
    s = Sampler(interval_s=0.05, gpu_index=0).start()
    s.stop()
    summ = s.summary()
    assert summ["samples"] >= 1
    assert isinstance(summ["gpu"], str)


def test_disabled_sampler_is_a_noop() -> None:
    s = make_sampler(enabled=False)
    assert isinstance(s, NullSampler)
    with s:
        pass
    assert s.summary() == {} and s.samples == []


def test_a_device_given_by_name_is_read_as_its_type() -> None:
    """check_profile accepts a bare device name; the verdict read it as an object (found by
    tests/test_record_fuzz.py with device "0")."""
    p = profile(0.0, steps=10, other=0.3)
    for dev in ("0", "cpu", {"type": "cpu"}):
        p["device"] = dev
        v = V.verdict(p)
        assert v.kind == "sync-bound"
        assert ("no device to wait on" in v.summary) == (dev != "0"), (dev, v.summary)
