"""The training loop's state: one dataclass, saved to and restored from a checkpoint.

Everything the summary counts over the whole run (a resumed run continues the counts)
lives here, so saving, restoring and summarising read the same fields. The checkpoint's
trainer_state.json keeps the key names it has always had (`_KEYS`): checkpoints written
before this class existed load unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pitstop.measure.timeline import PHASES
from pitstop.train.evaluate import EvalResult

# field -> trainer_state.json key (the file's names predate the fields' names)
_KEYS = {
    "step": "step",
    "epoch_float": "epoch",
    "trained_tokens": "trained_tokens",
    "seen_tokens": "seen_tokens",
    "padded_tokens": "padded_tokens",
    "skipped_steps": "skipped_steps",
    "bad_run": "bad_run",
    "train_seconds": "train_seconds",
    "wall_before": "wall_seconds",
    "ckpt_pause": "checkpoint_pause_seconds",
    "phase_totals": "time_breakdown",
    "last_loss": "last_loss",
    "last_loss_step": "last_loss_step",
    "last_eval": "last_eval",
}
# Keys a checkpoint may lack (written by older versions): the field keeps its default.
_OPTIONAL = {"epoch", "last_loss", "last_loss_step", "last_eval"}


def _zero_phases() -> dict[str, float]:
    return dict.fromkeys(PHASES, 0.0)


@dataclass
class RunState:
    """Counters of the whole run (all ranks), restored on --resume.

    `train_seconds` and `wall_before` hold the seconds of earlier processes of the run (and,
    for train_seconds, of this process once its loop has ended); `phase_totals` the seconds
    per timeline phase; `bad_run` the current run of consecutive non-finite steps.
    """

    step: int = 0
    epoch_float: float = 0.0
    trained_tokens: int = 0
    seen_tokens: int = 0
    padded_tokens: int = 0
    skipped_steps: int = 0
    bad_run: int = 0
    train_seconds: float = 0.0
    wall_before: float = 0.0
    ckpt_pause: float = 0.0
    phase_totals: dict[str, float] = field(default_factory=_zero_phases)
    last_loss: float | None = None
    last_loss_step: int | None = None  # the step of last_loss (later ones were skipped)
    last_eval: EvalResult | None = None  # as trainer_state.json holds it (a plain dict)

    def to_trainer_state(
        self, *, total_steps: int, train_seconds: float, wall_seconds: float
    ) -> dict[str, Any]:
        """trainer_state.json: the fields, with this process's seconds so far added in."""
        ts = {key: getattr(self, name) for name, key in _KEYS.items()}
        ts.update(total_steps=total_steps, train_seconds=train_seconds, wall_seconds=wall_seconds)
        ts["time_breakdown"] = dict(self.phase_totals)
        # Read by checkpoint retention: the best checkpoint by eval loss is kept.
        ev = self.last_eval
        ts["eval_loss"] = ev["eval_loss"] if ev and ev["step"] == self.step else None
        return ts

    @classmethod
    def from_trainer_state(cls, ts: dict[str, Any]) -> RunState:
        """The state a checkpoint's trainer_state.json records (any version's keys)."""
        state = cls()
        for name, key in _KEYS.items():
            if key not in ts and key in _OPTIONAL:
                continue
            default = getattr(state, name)
            value = ts[key]
            if name == "phase_totals":
                state.phase_totals.update({k: float(v) for k, v in value.items()})
            elif isinstance(default, (int, float)) and not isinstance(default, bool):
                setattr(state, name, type(default)(value))
            else:
                setattr(state, name, value)
        return state
