"""Issue 27: the six hostile inputs that ended in a Python traceback now end in a clean answer.

1-2. A measured-choices cache entry whose `key_fields` or `values` is a string: ignored
     with a one-line warning and measured again (then overwritten with a good entry).
3.   A run's choices.json whose `values` is a string, then `--resume`: refused, naming
     the file and the field.
4.   `pitstop report` on a metrics.jsonl line with `"step": "x"`: a DataError naming the
     file, the line and the field.
5.   `pitstop tune --output DIR` (an existing directory): refused before any work.
6.   `pitstop profile --trace FILE` (an existing file): refused before any work.
Plus the other outputs of the wrong kind (a file where a directory is needed, or under
a file), each refused before work starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pitstop.cli import main
from pitstop.core import run_record
from pitstop.core.run_record import read_choices


def _train_argv(model: Path, store: Path, out: Path, *extra: str) -> list[str]:
    return [
        "train", "--model", str(model), "--data", str(store), "--output", str(out),
        "--max-seq-len", "64", "--tokens-per-step", "128", "--micro-batch-size", "2",
        "--batching", "auto", "--max-steps", "2", "--save-steps", "2", "--report-to", "none",
        "--compile", "off", "--cache-dir", str(out.parent / "cache"), *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def auto_run(tmp_path_factory, tiny_model_dir: Path, rel_store: Path) -> Path:
    """A finished 2-step `--batching auto` run: it measured, cached and recorded its layout."""
    out = tmp_path_factory.mktemp("hostile") / "run"
    assert main(_train_argv(tiny_model_dir, rel_store, out)) == 0
    return out


def _cache_entries(run: Path) -> list[Path]:
    return sorted((run.parent / "cache" / "choices").glob("*.json"))


@pytest.mark.parametrize("field", ["key_fields", "values"])
def test_a_damaged_cache_entry_is_measured_again(
    auto_run: Path, tiny_model_dir: Path, rel_store: Path, field: str, capsys
) -> None:
    entries = _cache_entries(auto_run)
    assert entries, "the first run stored its measured layout"
    for e in entries:
        data = json.loads(e.read_text())
        e.write_text(json.dumps({**data, field: "a string"}))
    capsys.readouterr()
    code = main(_train_argv(tiny_model_dir, rel_store, auto_run, "--overwrite"))
    err = capsys.readouterr().err
    assert code == 0, err[-2000:]
    assert "Traceback" not in err
    warned = [line for line in err.splitlines() if "damaged measured-choices cache entry" in line]
    assert warned and f"'{field}'" in warned[0] and "measuring again" in warned[0]
    for e in _cache_entries(auto_run):  # measured again and stored over the damaged one
        assert read_choices(e).values["batching"] in ("pack", "bucket", "pad")


def test_a_damaged_choices_json_refuses_resume(
    auto_run: Path, tiny_model_dir: Path, rel_store: Path, capsys
) -> None:
    path = auto_run / run_record.CHOICES
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "values": "bucket"}))
    capsys.readouterr()
    argv = _train_argv(tiny_model_dir, rel_store, auto_run, "--resume", "--max-steps", "4")
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert str(path) in err and "field 'values' must be an object" in err


def test_report_names_the_metrics_line_and_field(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    run.mkdir()
    good = {"step": 1, "loss": 3.0, "step_seconds": 0.5, "forward_s": 0.2}
    lines = [good, {**good, "step": "x"}, {**good, "step": 3}]
    (run / run_record.METRICS).write_text("".join(json.dumps(r) + "\n" for r in lines))
    code = main(["report", str(run), "--output", str(tmp_path / "r.html")])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert "metrics.jsonl line 2: field 'step' must be an integer, got 'x'" in err


def _config_argv(model: Path, store: Path, tmp: Path) -> list[str]:
    return [
        "--model", str(model), "--data", str(store), "--max-seq-len", "64",
        "--tokens-per-step", "128", "--cache-dir", str(tmp / "cache"), "--report-to", "none",
    ]  # fmt: skip


def test_tune_output_that_is_a_directory(
    tmp_path: Path, tiny_model_dir: Path, rel_store: Path, capsys
) -> None:
    taken = tmp_path / "tuned"
    taken.mkdir()
    argv = ["tune", *_config_argv(tiny_model_dir, rel_store, tmp_path), "--output", str(taken)]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert f"--output {taken} is a directory; give a file path" in err
    assert not (tmp_path / "cache").exists()  # refused before any work


def test_profile_trace_that_is_a_file(
    tmp_path: Path, tiny_model_dir: Path, rel_store: Path, capsys
) -> None:
    trace = tmp_path / "trace"
    trace.write_text("not a directory")
    argv = ["profile", *_config_argv(tiny_model_dir, rel_store, tmp_path), "--trace", str(trace),
            "--output", str(tmp_path / "profile.json")]  # fmt: skip
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert f"--trace {trace} is a file; give a directory" in err
    assert not (tmp_path / "profile.json").exists()


@pytest.mark.parametrize(
    ("command", "kind"),
    [
        (["report", "RUN", "--output", "{dir}"], "is a directory; give a file path"),
        (["report", "RUN", "--output", "{file}/r.html"], "is a file, so nothing can be written"),
        (["export", "RUN", "--merge", "--output", "{file}"], "is a file; give a directory"),
        (["demo", "--output", "{file}"], "is a file; give a directory"),
        (["demo", "--output", "{file}/sub"], "is a file, so no directory can be made"),
    ],
)
def test_outputs_of_the_wrong_kind(tmp_path: Path, command: list[str], kind: str, capsys) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_text("a file")
    argv = [a.format(dir=tmp_path / "d", file=tmp_path / "f").replace("RUN", str(tmp_path / "d"))
            for a in command]  # fmt: skip
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and kind in err, err


def test_train_output_under_a_file(
    tmp_path: Path, tiny_model_dir: Path, rel_store: Path, capsys
) -> None:
    (tmp_path / "f").write_text("a file")
    out = tmp_path / "f" / "run"
    code = main(_train_argv(tiny_model_dir, rel_store, out, "--cache-dir", str(tmp_path / "c")))
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "is a file, so no directory can be made under it" in err
