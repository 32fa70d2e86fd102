"""Atomic writes: a failed write leaves the old file whole and no temporary behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from pitstop.core.atomic import write_cache_entry, write_json_atomic, write_text_atomic


class Boom:
    def __str__(self) -> str:  # json.dumps(default=str) calls this mid-serialisation
        raise RuntimeError("boom")


def test_replace_and_failure_keeps_the_old_file(tmp_path: Path) -> None:
    p = tmp_path / "summary.json"
    write_json_atomic(p, {"a": 1})
    assert p.read_text() == '{\n "a": 1\n}\n'
    with pytest.raises(RuntimeError):
        write_json_atomic(p, {"a": Boom()})
    assert p.read_text() == '{\n "a": 1\n}\n'
    assert [x.name for x in tmp_path.iterdir()] == ["summary.json"]


def test_interrupted_write_leaves_no_temporary(tmp_path: Path, monkeypatch) -> None:
    p = tmp_path / "config.yaml"
    write_text_atomic(p, "old")

    def fail(*_a, **_k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("pitstop.core.atomic.os.replace", fail)
    with pytest.raises(OSError):
        write_text_atomic(p, "new")
    assert p.read_text() == "old"
    assert [x.name for x in tmp_path.iterdir()] == ["config.yaml"]


def test_cache_entry_is_best_effort(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert write_cache_entry(tmp_path / "c" / "e.json", "{}") is True
    assert write_cache_entry(blocker / "sub" / "e.json", "{}") is False  # parent is a file
