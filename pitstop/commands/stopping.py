"""SIGTERM and SIGINT end a command through its cleanup, not around it.

Python's default for SIGTERM ends the process at once: `finally` blocks do not run, so a
half-written directory stays on disk and worker processes are left behind. Inside
`stop_on_signals`, either signal raises `Stopped`, so every cleanup on the way out runs; the
CLI prints its message and exits with 128 + the signal's number. `Stopped` is a
KeyboardInterrupt, as Ctrl-C's own exception is, so no `except Exception` on the way (a
tokenizer loader's, a reader's) takes it for a failure of its own.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from types import FrameType


class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped a command; its cleanup ran."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@contextlib.contextmanager
def stop_on_signals(what: str) -> Iterator[None]:
    """Within the block, SIGTERM and SIGINT raise `Stopped` saying `what` happened (e.g.
    "nothing was published; run the same command again")."""
    previous = {}

    def stop(signum: int, frame: FrameType | None) -> None:
        raise Stopped(f"{signal.Signals(signum).name} stopped it: {what}", 128 + signum)

    try:
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, stop)
    except ValueError:  # not the main thread (tests calling main() from a thread)
        pass
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
