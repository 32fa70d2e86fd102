"""What a run directory holds after `pitstop train`, and how a killed run still reports.

`pitstop train` writes report.html into OUT_DIR at the end (docs/run-directory.md lists it).
A run killed before summary.json exists is read from metrics.jsonl by `report`, `compare`
and `estimate --from-profile`; a malformed metrics.jsonl line is a DataError naming the
file and line, while a torn last line (what a kill leaves) is skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pitstop.cli import main
from pitstop.core.errors import DataError
from pitstop.report.compare import compare
from pitstop.report.runs import load_run


def test_train_command_writes_report_html(
    tiny_model_dir: Path, tiny_tokenizer, tmp_path: Path
) -> None:
    from _train_util import make_store

    store = make_store(tmp_path / "store", tiny_tokenizer, n_docs=20)
    out = tmp_path / "out"
    argv = [
        "train", "--model", str(tiny_model_dir), "--data", str(store), "--output", str(out),
        "--max-seq-len", "64", "--tokens-per-step", "256", "--micro-batch-size", "2",
        "--batching", "pack", "--max-steps", "2", "--report-to", "none",
        "--cache-dir", str(tmp_path / "cache"), "--compile", "off",
    ]  # fmt: skip
    assert main(argv) == 0
    html = (out / "report.html").read_text()
    assert "<html" in html.lower() and "tokens/s" in html


def _killed_run(d: Path, steps: int = 4, torn: bool = True) -> Path:
    d.mkdir()
    lines = [
        {"step": i, "loss": 9.0 - i, "trained_tokens": 100 * i, "seen_tokens": 120 * i,
         "padded_tokens": 128 * i, "step_trained_tokens": 100, "step_seconds": 0.5,
         "forward_s": 0.2, "backward_s": 0.25, "optimizer_s": 0.05}
        for i in range(1, steps + 1)
    ]  # fmt: skip
    text = "".join(json.dumps(r) + "\n" for r in lines)
    (d / "metrics.jsonl").write_text(text + ('{"step": 5, "lo' if torn else ""))
    return d


def test_killed_run_is_read_from_its_metrics(tmp_path: Path, capsys) -> None:
    run = load_run(_killed_run(tmp_path / "killed"))
    s = run.summary
    assert s.status and s.status.startswith("incomplete")
    assert s.optimizer_steps == 4 and s.trained_tokens == 400
    assert s.train_seconds == pytest.approx(2.0)
    assert s.tokens_per_second == pytest.approx(200.0)
    assert s.final_loss == 5.0 and s.time_breakdown["forward"] == pytest.approx(0.8)
    other = _killed_run(tmp_path / "other", steps=2, torn=False)
    res = compare(tmp_path / "killed", other)
    assert any("incomplete" in n for n in res["notes"])
    assert main(["report", str(tmp_path / "killed"), "--output", str(tmp_path / "r.html")]) == 0
    capsys.readouterr()
    code = main(["estimate", "--from-profile", str(tmp_path / "killed"), "--params", "1e6",
                 "--tokens", "1e6"])  # fmt: skip
    assert code == 0 and "measured" in capsys.readouterr().out


def test_malformed_metrics_line_names_file_and_line(tmp_path: Path, capsys) -> None:
    d = _killed_run(tmp_path / "bad", torn=False)
    lines = (d / "metrics.jsonl").read_text().splitlines()
    lines[1] = '{"step": 2, "loss": oops}'
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"metrics\.jsonl line 2 is not valid JSON"):
        load_run(d)
    assert main(["report", str(d), "--output", str(tmp_path / "r.html")]) == 1
    err = capsys.readouterr().err
    assert "line 2" in err and "Traceback" not in err


def test_directory_without_run_files_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"no summary\.json, and no metrics\.jsonl"):
        load_run(tmp_path)


@pytest.mark.slow  # a fresh interpreter: several seconds on 2 cores
def test_estimate_into_a_closed_pipe_has_no_traceback() -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    cmd = [sys.executable, "-m", "pitstop", "estimate", "--params", "7e9", "--tokens", "1e9",
           "--gpu", "H100"]  # fmt: skip
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the first write, as `| head` after its lines
    try:
        p = subprocess.run(cmd, stdout=w, stderr=subprocess.PIPE, env=env, timeout=120)
    finally:
        os.close(w)
    err = p.stderr.decode()
    assert p.returncode == 141 and "Traceback" not in err, err
