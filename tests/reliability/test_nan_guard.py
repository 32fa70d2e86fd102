"""Non-finite steps: one is skipped and counted; K in a row stop the run with a diagnostic.

The stop leaves the last good checkpoint loadable, and `--resume` from it (without the
injected NaN) ends bit-identical to a run that never diverged.
"""

from __future__ import annotations

import json

import pytest
import torch
from _rel import (
    assert_same_as,
    check_accepted_checkpoints,
    metric_lines,
    no_traceback,
    run,
    train_cmd,
    weights,
)

pytestmark = pytest.mark.slow


def test_one_nan_step_is_skipped_and_counted(
    tiny_model_dir, rel_store, tmp_path, capsys, monkeypatch
):
    from pitstop.cli import main

    out = tmp_path / "out"
    monkeypatch.setenv("PITSTOP_TEST_NAN_STEPS", "3")
    args = train_cmd(tiny_model_dir, rel_store, out, "--max-bad-steps", "2", steps=4)[3:]
    assert main(args) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "completed" and s["skipped_steps"] == 1 and s["optimizer_steps"] == 4
    lines = metric_lines(out)
    assert [r["skipped"] for r in lines] == [False, False, True, False]
    assert lines[2]["loss"] is None and all(
        r["loss"] is not None for r in lines if not r["skipped"]
    )
    assert all(torch.isfinite(t).all() for t in weights(out / "final").values())
    capsys.readouterr()


def test_nan_in_a_row_stops_keeps_the_checkpoint_and_resumes(
    tiny_model_dir, rel_store, reference, tmp_path
):
    out = tmp_path / "out"
    cmd = train_cmd(tiny_model_dir, rel_store, out, "--max-bad-steps", "2")
    bad = run(cmd, PITSTOP_TEST_NAN_STEPS="3,4")
    assert bad.returncode == 1, bad.stderr[-3000:]
    no_traceback(bad.stderr)
    err = " ".join(bad.stderr.split())
    assert "training stopped at step 4: 2 optimizer steps in a row had a non-finite loss" in err
    assert f"The last good checkpoint is {out / 'checkpoints' / 'step-2'}" in err
    assert "--lr" in err  # says what to try
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "diverged" and s["skipped_steps"] == 2
    assert check_accepted_checkpoints(out) == [2]  # nothing saved after the first bad step

    done = run([*cmd, "--resume"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_as(out, reference)
