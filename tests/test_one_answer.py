"""One answer per question: the cache root and the run directory's names."""

from __future__ import annotations

from pitstop.core import run_record
from pitstop.core.cache_layout import cache_root


def test_cache_root_prefers_the_flag_then_the_environment_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("PITSTOP_CACHE_DIR", str(tmp_path / "env"))
    assert cache_root(str(tmp_path / "flag")) == tmp_path / "flag"
    assert cache_root(None) == tmp_path / "env"
    monkeypatch.delenv("PITSTOP_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root(None) == tmp_path / "home" / ".cache" / "pitstop"


def test_a_directory_with_any_run_marker_is_refused_without_resume(tmp_path):
    from pitstop.probe import output_dir_problem

    for marker in run_record.RUN_MARKERS:
        d = tmp_path / marker.replace(".", "_")
        d.mkdir()
        if marker in run_record.RUN_DIRS:
            (d / marker).mkdir()
        else:
            (d / marker).write_text("{}")
        assert "already holds a run" in (
            output_dir_problem(str(d), resume=False, overwrite=False) or ""
        )
    assert output_dir_problem(str(tmp_path / "new"), resume=False, overwrite=False) is None
    assert set(run_record.RUN_MARKERS) <= set(run_record.RUN_FILES) | set(run_record.RUN_DIRS)


def test_the_doctor_resolves_precision_auto_with_the_probe():
    from types import SimpleNamespace

    from pitstop.advise.rules import Context
    from pitstop.probe import DeviceInfo, choose_precision

    for dev in (
        DeviceInfo(type="cpu", name="cpu", cpu_count=2),
        DeviceInfo(type="cuda", name="Tesla V100-SXM2-16GB", capability=(7, 0), bf16=False),
        DeviceInfo(type="cuda", name="NVIDIA A100-SXM4-80GB", capability=(8, 0), bf16=True),
    ):
        ctx = SimpleNamespace(
            setup=SimpleNamespace(precision="auto"), device=dev, measured_precision=None
        )
        assert Context.precision.fget(ctx) == choose_precision("auto", dev).value


def test_the_compile_run_length_estimate():
    from pitstop.probe import ASSUMED_MFU_FOR_ESTIMATE, estimated_run_seconds

    assert estimated_run_seconds(10, 100, 6.0, None) is None  # no peak: no estimate
    assert estimated_run_seconds(10, 100, 6.0, 1000.0) == 10 * 100 * 6.0 / (
        1000.0 * ASSUMED_MFU_FOR_ESTIMATE
    )
