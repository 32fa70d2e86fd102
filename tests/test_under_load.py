"""scripts/under_load.py: passes are counted in a row, the first failure stops the loop, and
the busy loops it starts are gone when it returns."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "under_load.py"


@pytest.fixture(scope="module")
def under_load():
    spec = importlib.util.spec_from_file_location("under_load", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _suite(tmp_path: Path, body: str) -> str:
    d = tmp_path / "suite"
    d.mkdir()
    (d / "test_one.py").write_text(f"def test_one():\n    {body}\n", encoding="utf-8")
    return str(d)


def test_every_pass_counted_and_the_hogs_stopped(under_load, tmp_path, capsys, monkeypatch):
    started = []
    real = under_load.start_hogs
    monkeypatch.setattr(under_load, "start_hogs", lambda n: started.extend(real(n)) or started)
    logs = tmp_path / "logs"
    argv = [_suite(tmp_path, "assert True"), "--runs", "2", "--hogs", "1", "--workers", "0"]
    assert under_load.main([*argv, "--log-dir", str(logs)]) == 0
    out = capsys.readouterr().out
    assert "pass 1: passed" in out and "pass 2: passed" in out
    assert "2 of 2 passed in a row" in out
    assert sorted(p.name for p in logs.iterdir()) == ["pass-1.txt", "pass-2.txt"]
    assert len(started) == 1 and all(h.poll() is not None for h in started)


def test_the_first_failure_stops_the_loop(under_load, tmp_path, capsys):
    logs = tmp_path / "logs"
    argv = [_suite(tmp_path, "assert False"), "--runs", "3", "--hogs", "0", "--workers", "0"]
    assert under_load.main([*argv, "--log-dir", str(logs)]) == 1
    out = capsys.readouterr().out
    assert "pass 1: FAILED (exit 1)" in out and "pass 2" not in out
    assert "0 of 3 passed in a row" in out
    assert "assert False" in (logs / "pass-1.txt").read_text(encoding="utf-8")


def test_bad_counts_are_refused(under_load, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        under_load.main(["--runs", "0", "--log-dir", str(tmp_path)])
    assert e.value.code == 2
    assert "--runs must be at least 1" in capsys.readouterr().err
