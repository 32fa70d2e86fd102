"""Stopping a pool of forked worker processes cleanly: what both of pitstop's process pools
(prepare's tokenizers, the epoch plan's row fill) need and `concurrent.futures` does not do.

- A forked worker keeps its parent's Python signal handlers. Under `stop_on_signals` that
  handler raises `Stopped`, so Ctrl-C (sent to the whole process group) would raise it in
  every worker too, each printing a traceback beside the parent's one line. Workers ignore
  SIGINT and take SIGTERM's default (`worker_signals`, their pool's initializer), and the
  stop signals are blocked while a worker is forked (`stop_signals_blocked`), so none lands
  between the fork and that initializer.
- A stop must not wait for the workers' current jobs (a chat template can take minutes over
  one record), and `ProcessPoolExecutor.shutdown` cannot be told to kill them; before
  Python 3.14 it has no way at all. `end_workers` kills them and unblocks the pool's manager
  thread, which a worker killed in the middle of sending a result would otherwise leave
  waiting forever (the CI failure of 2026-11-28: `prepare --workers 2` hung on SIGTERM).
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor

STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
# How long a terminated worker gets to go before it is killed.
TERMINATE_WAIT_SECONDS = 5.0


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """SIGINT and SIGTERM held back (delivered on leaving) in this thread, and so in the
    processes it forks (around a `submit`, which forks the workers), which unblock them in
    `worker_signals` once their own handlers are set."""
    if not hasattr(signal, "pthread_sigmask"):  # pragma: no cover - Windows
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def worker_signals() -> None:
    """A worker's first act: Ctrl-C is the parent's to handle, and a SIGTERM ends the worker
    without a traceback (the parent's `end_workers` sends it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def end_workers(ex: ProcessPoolExecutor) -> None:
    """Terminate the pool's workers now, then unblock the pool's manager thread, so that the
    `shutdown` that follows returns at once.

    A worker killed while it sends a result leaves half a message in the result pipe, and
    the manager thread waits for the rest of it forever. The parent holds the pipe's write
    end too; once every worker is gone, closing it turns that wait into an end of file,
    which the manager takes for a broken pool and cleans up after. Python 3.14's
    `terminate_workers` kills the workers but leaves that pipe as it is, so the same steps
    run on every version, through the executor's private fields (the same from 3.9 to 3.14;
    a step is skipped where its field is missing)."""
    procs = list((getattr(ex, "_processes", None) or {}).values())
    for proc in procs:
        with contextlib.suppress(Exception):  # already gone
            proc.terminate()
    for proc in procs:
        with contextlib.suppress(Exception):
            proc.join(TERMINATE_WAIT_SECONDS)
            if proc.is_alive():  # SIGTERM held up (a worker not yet past its start)
                proc.kill()
                proc.join()
    writer = getattr(getattr(ex, "_result_queue", None), "_writer", None)
    if writer is not None:
        with contextlib.suppress(OSError):
            writer.close()
