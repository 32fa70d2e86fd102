"""Fault injection for tests is read once, in pitstop/core/faults.py, and nowhere else.

The null object does nothing; named points die (SIGKILL, as from outside) or hold until
released; a malformed or unknown variable is an error that names the valid ones.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pitstop.core import faults
from pitstop.core.errors import PitstopError

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pitstop"


def test_no_other_production_module_reads_test_variables():
    readers = sorted(
        str(p.relative_to(ROOT))
        for p in PACKAGE.rglob("*.py")
        if faults.PREFIX in p.read_text(encoding="utf-8")
    )
    assert readers == ["pitstop/core/faults.py"], readers


def test_the_scan_would_see_a_reader(tmp_path):
    """The grep above is not vacuous: a module that names the prefix is found."""
    planted = tmp_path / "mod.py"
    planted.write_text('import os\nos.environ.get("PITSTOP_TEST_X")\n', encoding="utf-8")
    assert faults.PREFIX in planted.read_text(encoding="utf-8")


def test_default_is_the_null_object():
    f = faults.from_env({"PATH": "/bin", "PITSTOP_PROGRESS": "0"})
    assert f is faults.NO_FAULTS
    f.reached("step", 3)  # nothing happens
    assert not f.poisons(3) and not f.stops_after(3) and not f.fails_checkpoint(3)
    assert not f.out_of_memory(1, 10**6)


def test_variables_are_parsed_once_into_the_object(tmp_path):
    f = faults.from_env({
        "PITSTOP_TEST_DIE_AT": "ckpt-write:4", "PITSTOP_TEST_STOP_AT_STEP": "2",
        "PITSTOP_TEST_NAN_STEPS": "3,4", "PITSTOP_TEST_OOM_ROWS": "2:1",
        "PITSTOP_TEST_CKPT_FAIL": "6", "PITSTOP_TEST_HOLD_AT": "measured",
        "PITSTOP_TEST_HOLD_GATE": str(tmp_path / "g"),
    })  # fmt: skip
    assert f.die_at == faults.FaultPoint("ckpt-write", 4)
    assert f.die_at.matches("ckpt-write", 4) and not f.die_at.matches("ckpt-write", 2)
    assert f.hold_at == faults.FaultPoint("measured") and f.hold_at.matches("measured", None)
    assert f.stops_after(2) and not f.stops_after(3)
    assert f.poisons(3) and f.poisons(4) and not f.poisons(5)
    assert f.out_of_memory(2, 2) and not f.out_of_memory(2, 1) and not f.out_of_memory(1, 2)
    assert f.fails_checkpoint(6) and not f.fails_checkpoint(4)


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"PITSTOP_TEST_DIE_AT": "somewhere"}, "POINT one of startup"),
        ({"PITSTOP_TEST_DIE_AT": "step:x"}, "POINT or POINT:N"),
        ({"PITSTOP_TEST_CKPT_DELAY": "4:30"}, "unknown test fault variable"),
        ({"PITSTOP_TEST_HOLD_AT": "step:2"}, "needs PITSTOP_TEST_HOLD_GATE"),
        ({"PITSTOP_TEST_STOP_AT_STEP": "two"}, "expected a whole number"),
    ],
)
def test_bad_variables_are_refused_with_the_valid_choices(env, says):
    with pytest.raises(PitstopError, match=says):
        faults.from_env(env)


def _child(env: dict[str, str], code: str) -> subprocess.Popen:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.Popen([sys.executable, "-c", code], env=full, stderr=subprocess.PIPE)


def test_a_process_dies_at_its_named_point_only():
    code = (
        "from pitstop.core.faults import from_env\n"
        "f = from_env()\n"
        "f.reached('step', 2)\n"
        "print('past step 2', flush=True)\n"
        "f.reached('step', 3)\n"
        "raise SystemExit(5)\n"
    )
    proc = _child({"PITSTOP_TEST_DIE_AT": "step:3"}, code)
    proc.wait(120)
    assert proc.returncode == -signal.SIGKILL


def test_a_held_process_waits_for_its_gate(tmp_path):
    gate = tmp_path / "gate"
    code = "from pitstop.core.faults import from_env\nfrom_env().reached('measured')\n"
    env = {"PITSTOP_TEST_HOLD_AT": "measured", "PITSTOP_TEST_HOLD_GATE": str(gate)}
    proc = _child(env, code)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "gate.held").exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        assert proc.poll() is None  # still held: the gate does not exist yet
        gate.touch()
        assert proc.wait(60) == 0
    finally:
        proc.kill()
