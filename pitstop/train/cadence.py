"""What is due after an optimizer step: log, evaluate, save, stop; and when the run ends.

One object answers it, so the loop only acts on the answer. The run ends after
`last_step`; a hook (train/hooks.py) or a test fault asks to end sooner through
`stop_after` instead of rewriting the run's step count. A stop (SIGTERM/SIGINT, or
the test fault "stop after step N") saves a checkpoint and leaves; the end of the run
is "done" (final evaluation and final save follow).

Several processes: the time-based save and a signal are local facts; `agree` (an
all-reduce of flags) makes the ranks act on them together, at logging and save steps
only, the points where all ranks synchronise anyway.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from pitstop.core.config import RunConfig
from pitstop.core.faults import Faults

Agree = Callable[[tuple[bool, ...]], tuple[bool, ...]]


@dataclass(frozen=True)
class Due:
    done: bool  # the run's last step: final evaluation and save follow the loop
    log: bool
    eval: bool
    save: bool  # a checkpoint now (never at the last step: the final save writes that one)
    stop: bool  # save and leave (a signal, or a test's stop)
    compile_failed: bool = False  # some rank's torch.compile failed: every rank goes eager


class Cadence:
    def __init__(
        self,
        cfg: RunConfig,
        *,
        total_steps: int,
        has_eval: bool,
        faults: Faults,
        agree: Agree | None = None,
    ) -> None:
        self.cfg = cfg
        self.last_step = total_steps  # the run ends after this step
        self.has_eval = has_eval
        self.faults = faults
        self.agree = agree  # None: one process
        self.signal: int | None = None  # set by the signal handler (train/signals.py)
        # This rank's compile fell back (train/compile.py); the trainer sets it.
        self.compile_failed_here: Callable[[], bool] = lambda: False
        self._last_save = time.monotonic()

    def stop_after(self, step: int) -> None:
        """End the run after step `step` (a measurement: the hook has what it needs)."""
        self.last_step = step

    def running(self, step: int) -> bool:
        return step < self.last_step

    def due(self, step: int) -> Due:
        """What to do now that `step` (1-based) optimizer steps are done."""
        cfg = self.cfg
        done = step >= self.last_step
        save = bool(cfg.save_steps and step % cfg.save_steps == 0)
        log = step % cfg.log_steps == 0 or done
        timed = (
            cfg.save_minutes is not None
            and time.monotonic() - self._last_save >= 60 * cfg.save_minutes
        )
        signalled = self.signal is not None
        compile_failed = False  # one process: the guard already fell back by itself
        if self.agree is not None:  # ranks act on these together, at logging steps only
            if log or save:
                timed, signalled, compile_failed = self.agree(
                    (timed, signalled, self.compile_failed_here())
                )
            else:
                timed = signalled = False
        stop = signalled or self.faults.stops_after(step)
        evaluate = self.has_eval and (done or bool(cfg.eval_steps and step % cfg.eval_steps == 0))
        return Due(
            done=done,
            log=log or save or timed or stop or evaluate,
            eval=evaluate,
            save=(save or timed or stop) and not done,
            stop=stop and not done,
            compile_failed=compile_failed,
        )

    def saved(self) -> None:
        """A checkpoint was taken now: the time-based save counts from here."""
        self._last_save = time.monotonic()
