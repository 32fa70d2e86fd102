"""constraints.txt: the versions `make test` and `make demo` install, complete and well-formed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PIN = re.compile(r'^([A-Za-z0-9][A-Za-z0-9._-]*)==([^;\s]+); python_version == "(\d+\.\d+)"$')


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins(path: Path) -> dict[str, tuple[str, str]]:
    out = {}
    for ln in path.read_text(encoding="utf-8").splitlines():
        if not ln.strip() or ln.startswith("#"):
            continue
        m = PIN.match(ln)
        assert m, f"not a pin with a Python marker: {ln!r}"
        out[_norm(m[1])] = (m[2], m[3])
    return out


def _declared() -> set[str]:
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11+")
    meta = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    reqs = meta["dependencies"] + meta["optional-dependencies"]["dev"]
    return {_norm(re.match(r"[A-Za-z0-9._-]+", r)[0]) for r in reqs}


def test_every_declared_dependency_but_torch_is_pinned_for_one_python():
    pins = _pins(REPO / "constraints.txt")
    assert len({py for _, py in pins.values()}) == 1, "one lock, one Python version"
    missing = sorted(_declared() - {"torch"} - set(pins))
    assert not missing, f"not in constraints.txt (run `make lock`): {missing}"
    # torch is the Makefile's TORCH_PIN (the CPU build); CUDA-only packages never belong here.
    assert not [n for n in pins if n in {"torch", "triton"} or n.startswith("nvidia-")]


def test_the_makefile_installs_with_the_constraints():
    make = (REPO / "Makefile").read_text(encoding="utf-8")
    assert "CONSTRAINTS := constraints.txt" in make
    install = make[make.index("$(STAMP):") : make.index("touch $(STAMP)")]
    assert "$(CONSTRAINTS)" in install.splitlines()[0]  # a new lock reinstalls
    assert '-c $(CONSTRAINTS) -e ".[dev]"' in install


def test_write_constraints_pins_this_environment(tmp_path):
    dest = tmp_path / "c.txt"
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "write_constraints.py"), sys.executable, str(dest)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    pins = _pins(dest)
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    assert pins["pytest"] == (pytest.__version__, here)
    assert "torch" not in pins and "pitstop" not in pins


def test_write_constraints_refuses_wrong_arguments():
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "write_constraints.py")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "write_constraints.py VENV_PYTHON" in r.stderr
