"""prepare's pool of tokenizer processes: chunks in, results out in input order.

A bounded window of futures (multiprocessing.Pool.imap would read the whole input ahead;
a window keeps only ~2 chunks per worker in flight). While the oldest chunk is not back,
the stream says so every `TICK_SECONDS` (`WAITING`), so the progress bar can show the
rate falling instead of freezing: one record a chat template takes minutes over holds
every later chunk back.

Stopping: the workers never run the parent's SIGINT/SIGTERM handler (`tokenize.init_worker`
ignores SIGINT and leaves SIGTERM at its default), so Ctrl-C, which reaches the whole
process group, stops the parent alone, which prints one line. A stop or a failure in the
parent then terminates the workers instead of waiting for their chunks, which may take as
long as `--max-record-seconds` allows. The stop signals are blocked while a worker is
forked, so none lands between the fork and `init_worker`, where the parent's handler is
still in place.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import signal
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor, wait

from pitstop.data import tokenize
from pitstop.data.readers import Chunk
from pitstop.data.tokenize import ChunkResult, Settings

# How often a wait for the oldest chunk is reported (`WAITING`): the bar's refresh rate
# while it waits.
TICK_SECONDS = 1.0
# Yielded instead of a result while the oldest chunk is still being worked on.
WAITING: tuple[int, None] = (-1, None)

_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
# How long a terminated worker gets to go before it is killed.
_TERMINATE_WAIT_SECONDS = 5.0


def in_order(
    chunks: Iterator[tuple[int, Chunk]],
    settings: Settings,
    workers: int,
) -> Iterator[tuple[int, ChunkResult | None]]:
    """(bytes read, result of `process_chunk`) in input order, with at most ~2 chunks per
    worker in flight, and `WAITING` every `TICK_SECONDS` the oldest one is not back."""
    tick = TICK_SECONDS
    # fork starts workers in milliseconds with the tokenizer already loaded; spawn elsewhere.
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    ex = ProcessPoolExecutor(
        workers,
        mp_context=mp.get_context(method),
        initializer=_init_worker,
        initargs=(settings,),
    )
    window: deque[tuple[int, Future]] = deque()  # (bytes read, future)
    try:
        for done, c in chunks:
            with _stop_signals_blocked():  # the submit that forks the workers
                window.append((done, ex.submit(tokenize.process_chunk, c)))
            if len(window) > 2 * workers:
                yield from _oldest(window, tick)
        while window:
            yield from _oldest(window, tick)
    except BaseException:  # a stop, a failure, or the reader gone (GeneratorExit)
        _end_workers(ex)
        raise
    finally:
        ex.shutdown(wait=True, cancel_futures=True)


def _oldest(
    window: deque[tuple[int, Future]], tick: float
) -> Iterator[tuple[int, ChunkResult | None]]:
    done, fut = window[0]
    while not wait([fut], timeout=tick).done:
        yield WAITING
    window.popleft()
    yield done, fut.result()


@contextlib.contextmanager
def _stop_signals_blocked() -> Iterator[None]:
    """SIGINT and SIGTERM held back (delivered on leaving) in this thread, and so in the
    processes it forks, which unblock them once their own handlers are set."""
    if not hasattr(signal, "pthread_sigmask"):  # pragma: no cover - Windows
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _init_worker(settings: Settings) -> None:
    """A worker's first act: its own signal handling, then its tokenizer. Ctrl-C (sent to
    the whole process group) is the parent's to handle, and a SIGTERM ends the worker
    without a traceback; a fork would otherwise keep the parent's stop_on_signals handler,
    which raises `Stopped` in each worker and prints its traceback beside the parent's line."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if hasattr(signal, "SIGALRM"):  # the process is the pool's: its timer bounds a record
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    tokenize.init_worker(settings)


def _end_workers(ex: ProcessPoolExecutor) -> None:
    """Terminate the pool's workers now (shutting the pool down would wait for the chunk
    each one is on: minutes, for a slow record), then unblock the pool's manager thread.

    A worker killed while it sends a result leaves half a message in the result pipe, and
    the manager thread waits for the rest of it forever, so the `shutdown` after this would
    never return (seen: a SIGTERM to `prepare --workers 2`, hung in 1 run of 3). The parent
    holds the pipe's write end too; once every worker is gone, closing it turns that wait
    into an end of file, which the manager takes for a broken pool and cleans up after.
    Python 3.14's `terminate_workers` kills the workers but leaves that pipe as it is, so
    the same steps run on every version, through the executor's private fields (stable
    from 3.9 to 3.14; each step is skipped where a field is missing)."""
    procs = list((getattr(ex, "_processes", None) or {}).values())
    for proc in procs:
        with contextlib.suppress(Exception):  # already gone
            proc.terminate()
    for proc in procs:
        with contextlib.suppress(Exception):
            proc.join(_TERMINATE_WAIT_SECONDS)
            if proc.is_alive():  # SIGTERM held up (a worker not yet past its start)
                proc.kill()
                proc.join()
    writer = getattr(getattr(ex, "_result_queue", None), "_writer", None)
    if writer is not None:
        with contextlib.suppress(OSError):
            writer.close()
