"""The typed run record (pitstop/core/run_record.py): old run directories load, shapes are checked,
unknown keys survive a round trip, and every writer goes through `write_summary`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pitstop.core import run_record
from pitstop.core.errors import DataError
from pitstop.core.run_record import (
    ChoiceRecord,
    RunSummary,
    StepLine,
    read_choices,
    read_steps,
    read_summary,
    write_steps,
    write_summary,
)
from pitstop.report.compare import compare
from pitstop.report.html import render
from pitstop.report.runs import load_run

OLD = Path(__file__).parent / "fixtures" / "run_v0"  # written by main before the record existed


@pytest.mark.parametrize("name", ["train", "hf"])
def test_a_run_directory_from_before_the_record_still_loads(name: str) -> None:
    run = load_run(OLD / name)
    s = run.summary
    assert s.schema_version == 0  # written before the schema had a version
    assert s.optimizer_steps == 4 and len(run.steps) == 4
    assert s.trained_tokens and s.tokens_per_second and s.train_seconds
    assert s.time_breakdown["forward"] > 0
    assert s.source == ("hf" if name == "hf" else None)
    line = run.steps[-1]
    assert line.step == 4 and line.step_seconds and line.step_seconds > 0
    assert line.phases["forward"] > 0 and line.data_wait_s >= 0
    assert line.step_trained_tokens and line.step_trained_tokens > 0


def test_old_choices_json_loads_as_a_record() -> None:
    rec = read_choices(OLD / "train" / run_record.CHOICES)
    assert rec.values["batching"] in ("pack", "bucket", "pad")
    assert rec.key and rec.key_fields["format"] == 1 and rec.source == "run"
    assert "kept from this run" in rec.describe("batching")


def test_reports_read_the_old_runs(tmp_path: Path) -> None:
    runs = [load_run(OLD / "train"), load_run(OLD / "hf")]
    html = render(runs)
    assert "tokens/s" in html and "hf" in html
    res = compare(OLD / "train", OLD / "hf")
    assert {r["metric"] for r in res["metrics"]} >= {"tokens_per_second", "final_loss"}


def test_summary_round_trip_keeps_unknown_keys(tmp_path: Path) -> None:
    data = json.loads((OLD / "train" / run_record.SUMMARY).read_text())
    data["a_future_field"] = {"x": 1}
    s = RunSummary.from_json(data)
    assert s.extra == {"a_future_field": {"x": 1}}
    path = write_summary(tmp_path, s)
    again = read_summary(path)
    assert again.extra == {"a_future_field": {"x": 1}}
    assert again.schema_version == run_record.SCHEMA_VERSION
    assert again.trained_tokens == s.trained_tokens and again.choices == s.choices


def test_a_plain_loops_command_is_a_typed_field_and_version_1_files_read_it(
    tmp_path: Path,
) -> None:
    # A version-1 summary.json of `pitstop profile -- COMMAND` (the keys were extra then).
    old = {"schema_version": 1, "source": "script", "command": ["python", "loop.py", "m"]}
    s = RunSummary.from_json({**old, "command_cwd": "/work"})
    assert s.source == run_record.SOURCE_SCRIPT in run_record.SOURCES
    assert s.command == ["python", "loop.py", "m"] and s.command_cwd == "/work"
    assert s.extra == {}  # no longer unknown keys
    again = read_summary(write_summary(tmp_path, s))
    assert again.command == s.command and again.command_cwd == "/work"
    with pytest.raises(DataError, match="field 'command' must be a list of strings"):
        RunSummary.from_json({"command": "python loop.py"})


def test_write_summary_writes_no_nan(tmp_path: Path) -> None:
    path = write_summary(tmp_path, RunSummary(status="failed", final_loss=float("nan")))
    assert json.loads(path.read_text())["final_loss"] is None


@pytest.mark.parametrize(
    ("field", "value", "kind"),
    [
        ("optimizer_steps", "x", "an integer"),
        ("tokens_per_second", "fast", "a number"),
        ("time_breakdown", {"forward": "1"}, "an object of numbers"),
        ("choices", [1], "an object"),
        ("status", 3, "a string"),
    ],
)
def test_a_summary_field_of_the_wrong_type_is_named(
    tmp_path: Path, field: str, value: object, kind: str
) -> None:
    (tmp_path / "summary.json").write_text(json.dumps({"optimizer_steps": 2, field: value}))
    with pytest.raises(DataError, match=f"summary.json: field '{field}' must be {kind}"):
        read_summary(tmp_path)


def test_a_newer_schema_is_refused_with_the_fix(tmp_path: Path) -> None:
    (tmp_path / "summary.json").write_text(json.dumps({"schema_version": 99}))
    with pytest.raises(DataError, match="upgrade pitstop"):
        read_summary(tmp_path)


def test_step_lines_are_checked_by_line_and_field(tmp_path: Path) -> None:
    run = tmp_path / "r"
    shutil.copytree(OLD / "train", run)
    lines = (run / run_record.METRICS).read_text().splitlines()
    bad = json.loads(lines[1])
    bad["forward_s"] = "slow"
    lines[1] = json.dumps(bad)
    (run / run_record.METRICS).write_text("\n".join(lines) + "\n")
    with pytest.raises(
        DataError, match=r"metrics.jsonl line 2: field 'forward_s' must be a number"
    ):
        read_steps(run / run_record.METRICS)


def test_step_line_round_trip() -> None:
    raw = {"step": 3, "loss": 2.5, "step_seconds": 0.5, "forward_s": 0.2, "data_wait_s": 0.1,
           "checkpoint_s": 0.05, "eval_s": 0.0, "custom": "kept"}  # fmt: skip
    line = StepLine.from_json(raw)
    assert line.phases == {"forward": 0.2, "data_wait": 0.1, "checkpoint": 0.05, "eval": 0.0}
    assert line.pause_s == pytest.approx(0.05) and line.seconds == 0.5
    assert line.extra == {"custom": "kept"}
    assert StepLine.from_json(line.to_json()) == line


def test_choice_record_values_are_checked() -> None:
    good = json.loads((OLD / "train" / run_record.CHOICES).read_text())
    for values, field in (({"batching": "zigzag"}, "values.batching"),
                          ({"micro_batch_rows": 0}, "values.micro_batch_rows")):  # fmt: skip
        with pytest.raises(DataError, match=field):
            ChoiceRecord.from_json({**good, "values": values})
    with pytest.raises(DataError, match="field 'values' must be an object"):
        ChoiceRecord.from_json({**good, "values": "bucket"})


def test_write_steps_round_trip(tmp_path: Path) -> None:
    steps = read_steps(OLD / "hf" / run_record.METRICS)
    steps[0].grad_norm = float("inf")  # JSON has no Inf: written as null
    path = write_steps(tmp_path, steps)
    again = read_steps(path)
    assert [s.step for s in again] == [1, 2, 3, 4] and again[0].grad_norm is None
    assert again[0].loss is None and "loss" in json.loads(path.read_text().splitlines()[0])
    assert again[1].phases == steps[1].phases and again[1].extra == steps[1].extra
