"""bench/op_shares.py's self time: an op's time less the ops it called, per thread."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.op_shares import self_times, shares


def _x(name: str, ts: float, dur: float, tid: int = 1, cat: str = "cpu_op") -> dict:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "cat": cat}


def test_self_time_leaves_out_what_an_op_called(tmp_path: Path) -> None:
    events = [
        _x("aten::linear", 0, 100),  # calls mm (60) and add (10): 30 of its own
        _x("aten::mm", 5, 60),
        _x("aten::add", 70, 10),
        _x("## Call CompiledFxGraph abc ##", 200, 50, cat="user_annotation"),
        _x("aten::mm", 210, 20),  # inside the graph call: the graph keeps 30
        _x("aten::mul", 0, 40, tid=2),  # another thread: nests nothing above
        _x("ProfilerStep#9", 0, 1000, cat="user_annotation"),  # not an op
    ]
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    t = self_times(trace)
    assert t["aten::linear"] == pytest.approx(30e-6)
    assert t["aten::mm"] == pytest.approx(80e-6)
    assert t["aten::add"] == pytest.approx(10e-6)
    assert t["## Call CompiledFxGraph abc ##"] == pytest.approx(30e-6)
    assert t["aten::mul"] == pytest.approx(40e-6)
    assert "ProfilerStep#9" not in t
    s = shares(t)
    assert s["matmul"] == pytest.approx(80 / 190)
    assert s["compiled graphs"] == pytest.approx(30 / 190)
    assert s["the rest"] == pytest.approx(80 / 190)
