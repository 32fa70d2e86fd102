"""SIGTERM/SIGINT during a run: finish the step, save a checkpoint, say how to resume.

The handler only records the signal in the run's cadence (train/cadence.py); the loop
acts on it after the step, where the state is whole. A second Ctrl-C stops at once.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from pitstop.core import log, run_record
from pitstop.core.errors import PitstopError
from pitstop.train.cadence import Cadence


class RunInterrupted(PitstopError):
    """SIGTERM/SIGINT: the run saved a checkpoint and stopped; the message says how to resume."""

    def __init__(self, message: str, exit_code: int, stopped: str = "") -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.stopped = stopped or message  # "stopped by SIGINT after step 3 of 100"


class StopSignals:
    """`with StopSignals(cadence, ...)`: the handlers of a run (main thread only)."""

    def __init__(self, cadence: Cadence, *, announce: bool, next_step: Callable[[], int]) -> None:
        self.cadence = cadence
        self.announce = announce  # rank 0 prints
        self.next_step = next_step
        self._old: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, h in self._old.items():
            signal.signal(sig, h)
        self._old = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.cadence.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.cadence.signal = signum
        if self.announce:
            log.info(
                f"\npitstop: {signal.Signals(signum).name} received: finishing step "
                f"{self.next_step()}, then saving a checkpoint (Ctrl-C again to stop at once)"
            )


def interrupted(
    signum: int | None, *, out: Path, step: int, total_steps: int, checkpoint: Path | None
) -> RunInterrupted:
    """The error of a run stopped after `step` (no signal: a test's stop, as SIGTERM)."""
    signum = signum or signal.SIGTERM
    cmd = f"pitstop train --config {out / run_record.CONFIG} --resume"
    stopped = f"stopped by {signal.Signals(signum).name} after step {step} of {total_steps}"
    return RunInterrupted(
        f"{stopped}; checkpoint saved in {checkpoint}. Resume with:\n  {cmd}",
        exit_code=128 + int(signum),
        stopped=stopped,
    )
