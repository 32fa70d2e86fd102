"""`pitstop report` on crafted run directories: every value is escaped, no markup gets in.

A run directory's name, the phase keys of metrics.jsonl, the config values in
summary.json and the doctor's findings are all written by whoever made the run; a
report on a downloaded run must not run its author's script. The hostile report is
parsed with html.parser and compared with a report of the same structure made from
plain names: it may hold no element and no attribute that the plain one lacks.
"""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path

from pitstop.cli import main
from pitstop.report.html import attr, text

HOSTILE = "x\"'><img src=x onerror=alert(1)><script>alert(2)<\\script><svg onload=alert(3)>"
PHASE = 'fwd"><script>alert(4)</script><rect onclick="alert(5)'


class _Tags(HTMLParser):
    """Every (tag, attribute name) the document opens, and the data-* values as parsed."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.pairs: set[tuple[str, str]] = set()
        self.tags: set[str] = set()
        self.charts: set[str] = set()
        self.phases: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        for name, value in attrs:
            self.pairs.add((tag, name))
            if name == "data-chart":
                self.charts.add(value or "")
            if name == "data-phase":
                self.phases.add(value or "")

    handle_startendtag = handle_starttag


def _run_dir(root: Path, name: str, phase: str, value: str) -> Path:
    d = root / name
    d.mkdir(parents=True)
    summary = {
        "optimizer_steps": 2, "trained_tokens": 100, "train_seconds": 1.0, "wall_seconds": 2.0,
        "tokens_per_second": 100.0, "final_loss": 3.0, "peak_memory_bytes": 1 << 20,
        "device": value, "time_breakdown": {"forward": 0.5, phase: 0.2},
        "config": {"lr": 1e-3, "template": value},
        "choices": {"batching": {"value": value, "reason": value}},
    }  # fmt: skip
    (d / "summary.json").write_text(json.dumps(summary), encoding="utf-8")
    steps = [
        {"step": i, "loss": 3.0 - i / 10, "tokens_per_second": 100.0, "peak_memory_bytes": 1 << 20,
         "phases": {"forward": 0.1, phase: 0.05}}
        for i in (1, 2)
    ]  # fmt: skip
    (d / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps), encoding="utf-8")
    finding = {"severity": value, "title": value, "id": value, "evidence": value,
               "effect": value, "basis": value, "fix": value}  # fmt: skip
    (d / "findings.json").write_text(json.dumps({"findings": [finding]}), encoding="utf-8")
    return d


def _report(tmp_path: Path, tag: str, name: str, phase: str, value: str) -> str:
    a = _run_dir(tmp_path / tag / "a", name, phase, value)
    b = _run_dir(tmp_path / tag / "b", name + "2", phase, value + "2")
    out = tmp_path / tag / "report.html"
    rc = main(["report", str(a), str(b), "--output", str(out), "--price-per-gpu-hour", "2"])
    assert rc == 0
    return out.read_text(encoding="utf-8")


def test_crafted_run_makes_no_element_or_attribute(tmp_path):
    plain = _Tags()
    plain.feed(_report(tmp_path, "plain", "run", "extra", "value"))
    hostile_html = _report(tmp_path, "hostile", HOSTILE, PHASE, HOSTILE)
    hostile = _Tags()
    hostile.feed(hostile_html)

    assert "script" not in hostile.tags and "img" not in hostile.tags
    assert not [p for p in hostile.pairs if p[1].startswith("on")], hostile.pairs
    assert hostile.pairs <= plain.pairs, hostile.pairs - plain.pairs
    assert hostile.tags == plain.tags
    # The values survive, as values: escaped, not dropped or mangled.
    assert f"breakdown-{HOSTILE}" in hostile.charts
    assert PHASE in hostile.phases
    assert text(HOSTILE) in hostile_html


def test_helpers_escape_what_ends_text_and_attributes():
    assert "<" not in text("<script>") and ">" not in text("a>b") and "&amp;" in text("&")
    assert '"' not in attr('a"b') and "'" not in attr("a'b") and "<" not in attr("<")
