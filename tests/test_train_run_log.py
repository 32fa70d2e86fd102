"""RunLog: metrics lines reach metrics.jsonl, TensorBoard/wandb scalars and the progress lines."""

from __future__ import annotations

import json

import pytest

from pitstop.train.run_log import NullRun, NullWriter, RunLog


class _Sink:
    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []
        self.logged: list[tuple[dict, int]] = []

    def add_scalar(self, key, v, step):
        self.scalars.append((key, v, step))

    def log(self, data, step):
        self.logged.append((dict(data), step))

    def flush(self):
        pass


def _line(step: int, loss: float | None, **extra) -> dict:
    return {
        "step": step,
        "loss": loss,
        "lr": 1e-3,
        "grad_norm": 0.5,
        "tokens_per_second": 10.0,
        **extra,
    }


@pytest.fixture()
def cfg(tiny_model_dir, tmp_path):
    from _train_util import train_config

    return train_config(tiny_model_dir, tmp_path / "s", tmp_path / "out")


def test_lines_reach_every_sink_and_skipped_values_are_left_out(cfg, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PITSTOP_PROGRESS", "0")  # off a terminal: one printed line per logging step
    out = tmp_path / "out"
    out.mkdir()
    log = RunLog(cfg, out, enabled=True, total_steps=4)
    assert isinstance(log.tb, NullWriter) and isinstance(log.wb, NullRun)  # report_to none
    assert log.choices["tensorboard"].value is False
    log.tb, log.wb = _Sink(), _Sink()
    log.start_progress(0)
    lines = [_line(1, 2.5), _line(2, None, eval_loss=2.0, eval_ppl=float("inf"))]
    log.write(lines, trained_tokens=246, train_seconds=2.0, progress=True)
    log.stop_progress()
    written = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"], r.get("eval_loss", 0)) for r in written] == [
        (1, 2.5, 0), (2, None, 2.0),
    ]  # fmt: skip
    keys = {(k, s) for k, _, s in log.tb.scalars}
    assert ("train/loss", 1) in keys and ("train/loss", 2) not in keys  # a skipped step has no loss
    assert ("eval/loss", 2) in keys and ("eval/ppl", 2) not in keys  # non-finite: left out
    assert log.wb.logged[1][0] == {k: v for k, v, s in log.tb.scalars if s == 2}
    err = capsys.readouterr().err
    assert "step 2/4  loss skipped" in err and "123 tokens/s" in err
    assert "ETA 0m02s" in err  # 2 of 4 steps in 2.0 s: 2 steps left at 1 s each


def test_a_disabled_log_writes_nothing(cfg, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    log = RunLog(cfg, out, enabled=False, total_steps=4)
    log.start_progress(0)
    log.write([_line(1, 2.5)], trained_tokens=1, train_seconds=1.0, progress=True)
    log.append_metrics([_line(1, 2.5)])
    log.close()
    assert not (out / "metrics.jsonl").exists()


def test_phases_mfu_and_memory_reach_tensorboard_and_wandb(cfg, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    log = RunLog(cfg, out, enabled=True, total_steps=4)
    log.tb, log.wb = _Sink(), _Sink()
    line = _line(1, 2.5, mfu=0.42, forward_s=0.25, optimizer_s=0.5, step_seconds=1.0)
    line["peak_memory_gib"] = 3.5
    log.write([line], trained_tokens=1, train_seconds=1.0, progress=False)
    got = {k: v for k, v, _ in log.tb.scalars}
    assert got["train/mfu"] == 0.42 and got["train/step_seconds"] == 1.0
    assert got["time/forward"] == 0.25 and got["time/optimizer"] == 0.5
    assert got["memory/peak_gib"] == 3.5
    assert log.wb.logged[0][0] == got  # wandb gets the same series


class _FakeWandb:
    """Records wandb.init's arguments (wandb itself is not a test dependency)."""

    def __init__(self) -> None:
        self.inits: list[dict] = []

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return NullRun()


def test_wandb_resumes_the_same_run_id(cfg, tmp_path, monkeypatch):
    import dataclasses
    import sys

    from pitstop.train.run_log import open_wandb

    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_MODE", "offline")
    c = dataclasses.replace(cfg, report_to=["wandb"])
    out = tmp_path / "out"
    out.mkdir()
    _, note = open_wandb(c, out, True)
    _, _ = open_wandb(dataclasses.replace(c, resume=True), out, True)  # the run resumed
    first, again = fake.inits
    assert first["id"] == again["id"] and first["resume"] == again["resume"] == "allow"
    assert (out / "wandb-run-id").read_text().strip() == first["id"]
    assert first["id"] in note and "offline" in note
    other = tmp_path / "other"
    other.mkdir()
    open_wandb(c, other, True)
    assert fake.inits[-1]["id"] != first["id"]  # another run directory, another wandb run
