"""`--max-record-seconds`: how long rendering one record may take before it is skipped.

A chat template is Python code (jinja) run once per record, and one that loops over the
messages inside a loop over the messages takes minutes on one long conversation, while
every later chunk waits behind it (the pool returns chunks in input order). Like a record
too big to tokenize, such a record is skipped and counted, so one bad record costs at most
the limit, not the whole prepare.

The bound is a one-shot SIGALRM timer armed around each record's rendering: its handler
raises `RecordTimeout` in the middle of the template's loops. Signals reach Python in the
main thread only, which is where a tokenizer worker (and a one-process prepare) renders;
where the timer is not free (prepare called from another thread, or by a program with its
own SIGALRM handler or timer) the rendering runs to its end and is skipped afterwards when
it took longer, so the store does not depend on where prepare runs. Only rendering is timed: tokenizing is bounded by the record size limit
(`readers.MAX_RECORD_BYTES`) and runs in Rust, where no signal handler runs.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any


class RecordTimeout(BaseException):
    """Rendering one record took longer than the limit. A BaseException, as
    KeyboardInterrupt is, so the `except Exception` around a template's rendering does not
    take it for the template's own error."""


def _timer_free() -> bool:
    """Whether this thread may use SIGALRM: the main thread, with no SIGALRM handler or
    running timer of someone else's (a program that calls prepare_data may use them)."""
    return (
        hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, signal.SIG_IGN)
        and signal.getitimer(signal.ITIMER_REAL)[0] == 0
    )


class RenderLimit:
    """Within `with RenderLimit(seconds) as limit:`, `with limit.record():` around one
    record's rendering raises `RecordTimeout` once it has run `seconds` (0: no limit)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._armed = False
        self._timer = False  # a SIGALRM handler is installed: the timer interrupts
        self._previous: Any = None

    def __enter__(self) -> RenderLimit:
        if self.seconds > 0 and _timer_free():
            self._previous = signal.signal(signal.SIGALRM, self._expired)
            self._timer = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._timer:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._previous)
            self._timer = False

    def _expired(self, signum: int, frame: FrameType | None) -> None:
        if self._armed:  # a signal that arrives just after the record is done is ignored
            raise RecordTimeout

    @contextlib.contextmanager
    def record(self) -> Iterator[None]:
        if self.seconds <= 0:
            yield
            return
        start = time.monotonic()
        if self._timer:
            self._armed = True
            signal.setitimer(signal.ITIMER_REAL, self.seconds)
        try:
            yield
        finally:
            if self._timer:
                self._armed = False  # first: a late signal's handler then does nothing
                signal.setitimer(signal.ITIMER_REAL, 0)
        if not self._timer and time.monotonic() - start > self.seconds:
            raise RecordTimeout
