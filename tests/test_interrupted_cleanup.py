"""A step cut short by an error: the cleanup in Trainer._fit must not raise over it.

On CUDA the interrupted step's timing events may never complete, or the device is in an
error state: resolving them raises. Here (CPU) a Timeline whose records raise as CUDA's
would stands in for that; the run's own error must come out, and summary.json must still
be written ("failed").
"""

from __future__ import annotations

import json

import pytest

from pitstop.measure.timeline import StepRecord, Timeline

pytestmark = pytest.mark.slow


class Boom(Exception):
    """The real error of the step."""


class RaisingRecord(StepRecord):
    def resolve(self):
        raise RuntimeError("CUDA error: device not ready (elapsed_time of an unfinished event)")


class CudaLikeTimeline(Timeline):
    """After a failed step (`broken`), reading the step's timing raises as CUDA's does."""

    broken = False

    def end_step(self):
        rec = super().end_step()
        if CudaLikeTimeline.broken:
            return RaisingRecord(rec.step_seconds, rec.host, rec.events)
        return rec


class FailAtStep2:
    def __init__(self) -> None:
        self.n = 0

    def step_started(self) -> bool:
        self.n += 1
        if self.n == 2:
            CudaLikeTimeline.broken = True
            raise Boom("the real error in step 2")
        return False

    def step_ended(self, step: int) -> None:
        pass


# The shared `store` fixture (tests/conftest.py) builds a 12-chapter store here.
STORE_DOCS = 12


def test_the_real_error_comes_out_and_summary_is_written(
    tiny_model_dir, store, tmp_path, monkeypatch
) -> None:
    from _train_util import train_config

    import pitstop.train.trainer as trainer_mod

    monkeypatch.setattr(trainer_mod, "Timeline", CudaLikeTimeline)
    CudaLikeTimeline.broken = False
    out = tmp_path / "out"
    cfg = train_config(tiny_model_dir, store, out, max_steps=3, log_steps=1)
    with pytest.raises(Boom, match="the real error"):
        trainer_mod.Trainer.from_config(cfg, hooks=FailAtStep2()).fit()
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "failed" and s["optimizer_steps"] == 1
