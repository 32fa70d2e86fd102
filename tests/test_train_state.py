"""RunState: the loop's counters save to and restore from a checkpoint's trainer_state."""

from __future__ import annotations

import json

from pitstop.measure.timeline import PHASES
from pitstop.train.state import RunState

# trainer_state.json as written before RunState existed (the keys are the file's contract).
OLD = {
    "step": 4, "epoch": 0.5, "total_steps": 8, "trained_tokens": 900, "seen_tokens": 1000,
    "padded_tokens": 1024, "skipped_steps": 1, "bad_run": 0, "train_seconds": 3.5,
    "wall_seconds": 9.25, "checkpoint_pause_seconds": 0.125,
    "time_breakdown": {**dict.fromkeys(PHASES, 0.0), "forward": 1.5}, "last_loss": 7.75,
    "last_eval": {"step": 4, "eval_loss": 7.5}, "eval_loss": 7.5,
}  # fmt: skip


def test_an_old_trainer_state_restores_every_counter():
    s = RunState.from_trainer_state(OLD)
    assert (s.step, s.epoch_float, s.trained_tokens, s.seen_tokens, s.padded_tokens) == (
        4, 0.5, 900, 1000, 1024,
    )  # fmt: skip
    assert (s.skipped_steps, s.bad_run, s.train_seconds, s.wall_before, s.ckpt_pause) == (
        1, 0, 3.5, 9.25, 0.125,
    )  # fmt: skip
    assert s.phase_totals["forward"] == 1.5 and set(s.phase_totals) == set(PHASES)
    assert s.last_loss == 7.75 and s.last_eval == {"step": 4, "eval_loss": 7.5}


def test_keys_older_versions_lacked_keep_their_defaults():
    old = {k: v for k, v in OLD.items() if k not in ("epoch", "last_loss", "last_eval")}
    s = RunState.from_trainer_state(old)
    assert s.epoch_float == 0.0 and s.last_loss is None and s.last_eval is None
    assert s.step == 4


def test_save_then_restore_is_the_same_state_and_the_same_keys():
    s = RunState.from_trainer_state(OLD)
    saved = json.loads(
        json.dumps(s.to_trainer_state(total_steps=8, train_seconds=3.5, wall_seconds=9.25))
    )
    # The file before the redesign, key for key, plus the one key issue 20 added (the step
    # of the last finite loss; an older checkpoint without it restores as None).
    assert saved == {**OLD, "last_loss_step": None}
    assert RunState.from_trainer_state(saved) == s


def test_eval_loss_is_recorded_only_for_an_evaluation_of_this_step():
    s = RunState.from_trainer_state({**OLD, "last_eval": {"step": 2, "eval_loss": 7.9}})
    assert (
        s.to_trainer_state(total_steps=8, train_seconds=0.0, wall_seconds=0.0)["eval_loss"] is None
    )
