"""Non-finite weights are never saved: no checkpoint and no final/ holds NaN/Inf.

The gradient guard skips steps with a non-finite loss or gradient; these tests break
the *weights* instead (an update that overflows, or --lr 1e9), which that guard
cannot see. The run must stop at the step that broke them, keep only the checkpoints
from before it, and report the last finite step's loss.
"""

from __future__ import annotations

import json

import pytest
import torch
from _rel import check_accepted_checkpoints, metric_lines, no_traceback, run, train_cmd, weights

pytestmark = pytest.mark.slow


def _break_weights_at(monkeypatch, step: int) -> None:
    """After optimizer step `step` (1-based), one weight becomes NaN (finite gradient, bad update)."""
    from pitstop.train.trainer import Trainer

    real = Trainer.optimizer_step

    def step_then_break(self, loss):
        out = real(self, loss)
        if self.state.step + 1 == step:
            with torch.no_grad():
                self.run.params[0].view(-1)[0] = float("nan")
        return out

    monkeypatch.setattr(Trainer, "optimizer_step", step_then_break)


def test_update_that_breaks_the_weights_stops_before_any_save(
    tiny_model_dir, rel_store, tmp_path, capsys, monkeypatch
):
    from pitstop.cli import main

    out = tmp_path / "out"
    _break_weights_at(monkeypatch, 3)
    # Logging every 4 steps: the flag of step 3 is read at step 4's logging, before its save.
    args = train_cmd(tiny_model_dir, rel_store, out, "--log-steps", "4")[3:]
    assert main(args) == 1
    err = " ".join(capsys.readouterr().err.split())
    no_traceback(err)
    assert "the update of optimizer step 3 made weights non-finite" in err, err[-2000:]
    assert f"The last good checkpoint is {out / 'checkpoints' / 'step-2'}" in err
    assert "fp16" not in err  # an fp32 run gets no fp16 advice
    assert check_accepted_checkpoints(out) == [2]  # also asserts every saved weight is finite
    assert not (out / "final").exists()
    s = json.loads((out / "summary.json").read_text())
    lines = metric_lines(out)
    assert s["status"] == "diverged"
    assert s["final_loss"] == lines[1]["loss"] and s["final_loss_step"] == 2
    assert lines[2]["weights_finite"] is False


def test_huge_lr_never_saves_non_finite_weights(tiny_model_dir, rel_store, tmp_path):
    out = tmp_path / "out"
    r = run(train_cmd(tiny_model_dir, rel_store, out, "--lr", "1e9", "--max-bad-steps", "2"))
    no_traceback(r.stderr)
    check_accepted_checkpoints(out)  # every checkpoint it accepts is finite
    if (out / "final").exists():
        assert all(torch.isfinite(t).all() for t in weights(out / "final").values())
    s = json.loads((out / "summary.json").read_text())
    finite = [
        x for x in metric_lines(out) if x["loss"] is not None and x.get("weights_finite", True)
    ]
    assert s["final_loss"] == (finite[-1]["loss"] if finite else None)
    if r.returncode == 0:
        assert s["status"] == "completed"
        if s["final_loss_step"] != s["optimizer_steps"]:
            assert f"(step {s['final_loss_step']}, the last finite one)" in r.stderr
    else:
        assert r.returncode == 1 and s["status"] == "diverged", r.stderr[-2000:]
        assert "fp16" not in r.stderr, r.stderr[-2000:]
