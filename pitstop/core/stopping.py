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
from collections.abc import Callable, Iterator
from types import FrameType


class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped a command; its cleanup ran."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


Handler = Callable[[int, "FrameType | None"], None]


@contextlib.contextmanager
def on_stop_signals(handler: Handler) -> Iterator[None]:
    """`handler` for SIGTERM and SIGINT within the block, the previous ones restored after;
    nothing is installed off the main thread (tests calling main() from a thread)."""
    previous = {}
    with contextlib.suppress(ValueError):
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def stop_on_signals(command: str, what: str) -> contextlib.AbstractContextManager[None]:
    """Within the block, SIGTERM and SIGINT raise `Stopped`: "SIGTERM stopped `command`:
    `what`" (e.g. "the export", "nothing was written; run the same command again")."""

    def stop(signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        raise Stopped(f"{name} stopped {command}: {what}", 128 + signum)

    return on_stop_signals(stop)
