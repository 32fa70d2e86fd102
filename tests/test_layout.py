"""One answer per question: the cache root and the run directory's names."""

from __future__ import annotations

from pitstop import run_files
from pitstop.cache_layout import cache_root


def test_cache_root_prefers_the_flag_then_the_environment_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("PITSTOP_CACHE_DIR", str(tmp_path / "env"))
    assert cache_root(str(tmp_path / "flag")) == tmp_path / "flag"
    assert cache_root(None) == tmp_path / "env"
    monkeypatch.delenv("PITSTOP_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root(None) == tmp_path / "home" / ".cache" / "pitstop"


def test_a_directory_with_any_run_marker_is_refused_without_resume(tmp_path):
    from pitstop.probe import output_dir_problem

    for marker in run_files.RUN_MARKERS:
        d = tmp_path / marker.replace(".", "_")
        d.mkdir()
        if marker in run_files.RUN_DIRS:
            (d / marker).mkdir()
        else:
            (d / marker).write_text("{}")
        assert "already holds a run" in (
            output_dir_problem(str(d), resume=False, overwrite=False) or ""
        )
    assert output_dir_problem(str(tmp_path / "new"), resume=False, overwrite=False) is None
    assert set(run_files.RUN_MARKERS) <= set(run_files.RUN_FILES) | set(run_files.RUN_DIRS)
