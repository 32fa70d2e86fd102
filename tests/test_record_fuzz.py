"""Random JSON shapes into every reader of a file pitstop reads back (issue 27).

Each reader must return a clean result or raise a PitstopError; never another exception.
Two kinds of input: any JSON value at all, and a valid record (from the run directories
in tests/fixtures/run_v0) with one field replaced by any JSON value, which reaches the
checks a random object never gets past. What loads cleanly is also rendered and compared,
so a value the readers let through cannot crash the report either.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pitstop.batching.choices import load_cached, read_run_choices
from pitstop.core import run_record
from pitstop.core.errors import PitstopError
from pitstop.core.run_record import ChoiceRecord, RunSummary, StepLine
from pitstop.measure.schema import check_profile
from pitstop.measure.verdict import verdict
from pitstop.report.compare import compare
from pitstop.report.html import render
from pitstop.report.measured import load_measured
from pitstop.report.runs import load_run

OLD = Path(__file__).parent / "fixtures" / "run_v0"
SUMMARY = json.loads((OLD / "train" / run_record.SUMMARY).read_text())
HF_SUMMARY = json.loads((OLD / "hf" / run_record.SUMMARY).read_text())
STEP = json.loads((OLD / "train" / run_record.METRICS).read_text().splitlines()[0])
CHOICE = json.loads((OLD / "train" / run_record.CHOICES).read_text())
PROFILE = json.loads((OLD / "hf" / run_record.HF_PROFILE).read_text())

SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)

scalars = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=8)
    | st.floats(allow_nan=True, allow_infinity=True)
)  # fmt: skip
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


def _mutated(base: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """`base` with one of its keys (or a nested value's key) set to any JSON value."""
    keys = sorted(base)
    return st.builds(lambda k, v: {**base, k: v}, st.sampled_from(keys), json_values) | st.builds(
        lambda v: v, json_values
    )


def _clean(fn: Any, *args: Any) -> Any:
    """fn(*args), or None when it refuses with a PitstopError (any other exception fails)."""
    try:
        return fn(*args)
    except PitstopError:
        return None


def _write_run(d: Path, summary: Any, step: Any) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / run_record.SUMMARY).write_text(json.dumps(summary), encoding="utf-8")
    lines = [json.dumps(STEP), json.dumps(step), json.dumps({**STEP, "step": 3})]
    (d / run_record.METRICS).write_text("\n".join(lines) + "\n", encoding="utf-8")


@SETTINGS
@given(summary=_mutated(SUMMARY), step=_mutated(STEP))
def test_run_directory_readers(summary: Any, step: Any) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        _write_run(run, summary, step)
        loaded = _clean(load_run, run)
        if loaded is not None:  # what loads renders and compares without a traceback
            render([loaded, load_run(OLD / "hf")], price=2.0)
            compare(loaded, load_run(OLD / "train"), 2.0)
        _clean(load_measured, run)
        _clean(load_run, _no_summary(run))


def _no_summary(run: Path) -> Path:
    (run / run_record.SUMMARY).unlink()
    return run


@SETTINGS
@given(value=json_values, hf=_mutated(HF_SUMMARY))
def test_summary_and_step_records(value: Any, hf: Any) -> None:
    for data in (value, hf):
        s = _clean(RunSummary.from_json, data)
        if s is not None:
            assert RunSummary.from_json(s.to_json()).to_json() == s.to_json()
            s.device_name, s.choice_values(), s.choice_reason("compile")
        line = _clean(StepLine.from_json, data)
        if line is not None:
            line.seconds, line.pause_s, line.data_wait_s, line.number("loss")


@SETTINGS
@given(choice=_mutated(CHOICE), values=json_values)
def test_choice_readers(choice: Any, values: Any) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for data in (choice, {**CHOICE, "values": values}, {**CHOICE, "key_fields": values}):
            rec = _clean(ChoiceRecord.from_json, data)
            if rec is not None:
                rec.describe("batching")
            run = Path(tmp)
            (run / run_record.CHOICES).write_text(json.dumps(data), encoding="utf-8")
            _clean(read_run_choices, run)  # a damaged choices.json: a clear refusal
            entry = run / "choices" / f"{CHOICE['key']}.json"
            entry.parent.mkdir(exist_ok=True)
            entry.write_text(json.dumps(data), encoding="utf-8")
            load_cached(run, CHOICE["key"])  # a damaged cache entry: None, never an error


@SETTINGS
@given(profile=_mutated(PROFILE))
def test_profile_readers(profile: Any) -> None:
    checked = _clean(check_profile, profile)
    if checked is not None:
        _clean(verdict, checked)
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "profile.json"
        p.write_text(json.dumps(profile), encoding="utf-8")
        _clean(load_measured, p)
