"""prepare's pool of tokenizer processes: chunks in, results out in input order.

A bounded window of futures (multiprocessing.Pool.imap would read the whole input ahead;
a window keeps only ~2 chunks per worker in flight). While the oldest chunk is not back,
the stream says so every `TICK_SECONDS` (`WAITING`), so the progress bar can show the
rate falling instead of freezing: one record a chat template takes minutes over holds
every later chunk back.

Stopping (`pitstop.core.forked_workers`): the workers never run the parent's SIGINT/SIGTERM
handler, so Ctrl-C, which reaches the whole process group, stops the parent alone, which
prints one line. A stop or a failure in the parent then terminates the workers instead of
waiting for their chunks, which may take as long as `--max-record-seconds` allows.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor, wait

from pitstop.core import forked_workers
from pitstop.data import tokenize
from pitstop.data.readers import Chunk
from pitstop.data.tokenize import ChunkResult, Settings

# How often a wait for the oldest chunk is reported (`WAITING`): the bar's refresh rate
# while it waits.
TICK_SECONDS = 1.0
# Yielded instead of a result while the oldest chunk is still being worked on.
WAITING: tuple[int, None] = (-1, None)


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
            with forked_workers.stop_signals_blocked():  # the submit that forks the workers
                window.append((done, ex.submit(tokenize.process_chunk, c)))
            if len(window) > 2 * workers:
                yield from _oldest(window, tick)
        while window:
            yield from _oldest(window, tick)
    except BaseException:  # a stop, a failure, or the reader gone (GeneratorExit)
        forked_workers.end_workers(ex)
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


def _init_worker(settings: Settings) -> None:
    """A worker's first act: its own signal handling (`forked_workers.worker_signals`),
    then its tokenizer."""
    if hasattr(signal, "SIGALRM"):  # the process is the pool's: its timer bounds a record
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
    forked_workers.worker_signals()
    tokenize.init_worker(settings)
