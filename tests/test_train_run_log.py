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
    log.write(lines, tokens_per_second=123.0, progress=True)
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


def test_a_disabled_log_writes_nothing(cfg, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    log = RunLog(cfg, out, enabled=False, total_steps=4)
    log.start_progress(0)
    log.write([_line(1, 2.5)], tokens_per_second=1.0, progress=True)
    log.append_metrics([_line(1, 2.5)])
    log.close()
    assert not (out / "metrics.jsonl").exists()
