"""The report says what findings.json held: missing, an empty list, findings, or unreadable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_report_compare import make_run

from pitstop.core import run_record
from pitstop.report.html import render, text
from pitstop.report.runs import FINDINGS_MISSING, FINDINGS_READ, load_run

FINDING = {"id": "data-wait", "severity": "high", "title": "The GPU waits for data",
           "evidence": "data_wait is 40% of step time", "effect": "up to 1.6x faster",
           "basis": "measured on this run", "fix": "--loader-workers 4"}  # fmt: skip
NOTHING = "the doctor found nothing to change"
MISSING = "no findings.json"


def _doctor_report(findings: list[dict[str, object]]) -> dict[str, object]:
    """The shape the doctor, the demo and PitstopCallback write: the whole report."""
    return {"environment": {}, "findings": findings, "verdict": None, "setup": {}, "target": None}


def test_an_empty_doctor_report_reads_nothing_to_change(tmp_path: Path) -> None:
    # The demo's case: the doctor ran, found nothing, and its report was written.
    run_dir = make_run(tmp_path / "demo-run")
    run_record.write_findings(run_dir, _doctor_report([]))
    run = load_run(run_dir)
    assert run.findings == [] and run.findings_state == FINDINGS_READ
    page = render([run])
    assert NOTHING in page and MISSING not in page


def test_an_empty_bare_list_reads_nothing_to_change(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "bare")
    (run_dir / run_record.FINDINGS).write_text("[]")
    page = render([load_run(run_dir)])
    assert NOTHING in page and MISSING not in page


def test_a_missing_file_still_says_run_the_doctor(tmp_path: Path) -> None:
    run = load_run(make_run(tmp_path / "none"))
    assert run.findings_state == FINDINGS_MISSING
    page = render([run])
    assert MISSING in page and "pitstop doctor" in page and NOTHING not in page


def test_findings_are_a_table(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "some")
    run_record.write_findings(run_dir, _doctor_report([FINDING]))
    page = render([load_run(run_dir)])
    assert "The GPU waits for data" in page
    assert NOTHING not in page and MISSING not in page


@pytest.mark.parametrize(
    ("content", "said"),
    [
        ("{not json", "findings.json could not be read"),
        (
            json.dumps({"verdict": None}),
            'findings.json holds no list of findings (under "findings")',
        ),
        (
            json.dumps({"findings": ["x", 3]}),
            "findings.json holds 2 entries, none of them a finding",
        ),
    ],
)
def test_an_unreadable_file_says_why_not_that_nothing_was_found(
    tmp_path: Path, content: str, said: str
) -> None:
    run_dir = make_run(tmp_path / "bad")
    (run_dir / run_record.FINDINGS).write_text(content)
    page = render([load_run(run_dir)])
    assert text(said) in page
    assert NOTHING not in page and MISSING not in page
