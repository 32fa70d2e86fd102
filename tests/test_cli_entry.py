"""The process entry point: a torchrun worker leaves without the interpreter's teardown.

After a gloo run torch keeps the process group's worker threads alive past
`destroy_process_group`; tearing them down while the interpreter finalized sometimes
aborted a rank after a completed run (seen in a full-suite run of
tests/test_distributed.py::test_torchrun_fsdp2_on_gloo_matches_one_process). The torchrun
tests in tests/test_distributed.py run the real path; these pin the decision.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import pitstop.cli as cli

REPO = Path(__file__).resolve().parents[1]


class _Exited(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


@pytest.fixture()
def fake_exit(monkeypatch):
    calls: list[int] = []

    def _exit(code: int) -> None:
        calls.append(code)
        raise _Exited(code)

    monkeypatch.setattr(cli.os, "_exit", _exit)
    monkeypatch.setattr(cli, "main", lambda: 3)
    return calls


def test_a_torchrun_worker_exits_at_once_with_main_s_code(monkeypatch, fake_exit):
    import torch.distributed  # noqa: F401  (a worker has it loaded)

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(_Exited):
        cli.entry()
    assert fake_exit == [3]


@pytest.mark.parametrize("world", [None, "1"])
def test_a_single_process_exits_normally(monkeypatch, fake_exit, world):
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(SystemExit) as e:
        cli.entry()
    assert e.value.code == 3 and fake_exit == []


def test_python_m_pitstop_and_the_script_use_entry():
    main_py = (REPO / "pitstop" / "__main__.py").read_text(encoding="utf-8")
    assert "entry()" in main_py
    assert 'pitstop = "pitstop.cli:entry"' in (REPO / "pyproject.toml").read_text("utf-8")
    r = subprocess.run(
        [sys.executable, "-m", "pitstop", "estimate", "--no-such-flag"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert r.returncode == 2 and "unrecognized arguments" in r.stderr
