"""The row fill of the step plan (issue 32): the per-length FIFO implementation gives
exactly the rows of the sorted-list one it replaced (kept here as the reference), so every
plan, and with it the golden losses and resumes, is unchanged."""

from __future__ import annotations

import bisect
import sys

import numpy as np
import pytest

from pitstop.batching import plan as plan_mod
from pitstop.batching.plan import LOOKAHEAD, _fill_rows, build_plan


def reference_fill_rows(
    lengths: list[int], msl: int, window: int = LOOKAHEAD
) -> tuple[list[int], list[int]]:
    """The implementation before issue 32, verbatim: the window as one sorted list of keys
    length * (n + 1) + (n - i), so the largest key at most a capacity is the longest
    fitting sequence and, among equal lengths, the oldest."""
    n = len(lengths)
    placed = bytearray(n)
    win: list[int] = []
    nxt = head = 0
    flat: list[int] = []
    bounds = [0]
    while head < n:
        while nxt < n and len(win) < window:
            bisect.insort(win, lengths[nxt] * (n + 1) + (n - nxt))
            nxt += 1
        while placed[head]:
            head += 1
        if nxt - head >= 2 * window:
            first = head
            win.remove(lengths[first] * (n + 1) + (n - first))
        else:
            first = n - win.pop() % (n + 1)
        placed[first] = 1
        flat.append(first)
        cap = msl - lengths[first]
        while cap > 0 and win:
            j = bisect.bisect_right(win, cap * (n + 1) + n) - 1
            if j < 0:
                break
            key = win.pop(j)
            i = n - key % (n + 1)
            placed[i] = 1
            flat.append(i)
            cap -= lengths[i]
            if nxt < n:
                bisect.insort(win, lengths[nxt] * (n + 1) + (n - nxt))
                nxt += 1
        bounds.append(len(flat))
        while head < n and placed[head]:
            head += 1
    return flat, bounds


def _lengths(kind: str, n: int, msl: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "long_tailed":
        x = rng.lognormal(np.log(max(2, msl / 6)), 1.0, n).astype(np.int64)
    elif kind == "uniform":
        x = rng.integers(1, msl + 1, n)
    elif kind == "few_values":  # many ties: the oldest-first order among equal lengths
        x = rng.choice([1, msl // 4, msl // 2, msl], n)
    elif kind == "mostly_full":  # rows of one sequence, and sequences that never fit
        x = np.where(rng.random(n) < 0.7, msl, rng.integers(msl // 2, msl + 1, n))
    else:  # "tiny": dozens per row
        x = rng.integers(1, 4, n)
    return np.clip(x, 1, msl)


CASES = [
    (kind, n, msl, window, seed)
    for kind in ("long_tailed", "uniform", "few_values", "mostly_full", "tiny")
    for n, msl, window in [(1, 8, 4), (37, 16, 4), (500, 64, 8), (3000, 128, 32), (4000, 512, 512)]
    for seed in (0, 1)
]


@pytest.mark.parametrize(("kind", "n", "msl", "window", "seed"), CASES)
def test_fill_rows_equals_the_reference(kind: str, n: int, msl: int, window: int, seed: int):
    lengths = _lengths(kind, n, msl, seed)
    flat, bounds = _fill_rows(lengths, msl, window)
    want_flat, want_bounds = reference_fill_rows(lengths.tolist(), msl, window)
    assert list(flat) == want_flat
    assert list(bounds) == want_bounds
    assert sorted(want_flat) == list(range(n))  # every sequence once: the test can fail


def _reference_adapter(lengths: np.ndarray, msl: int, window: int = LOOKAHEAD):
    flat, bounds = reference_fill_rows(np.asarray(lengths).tolist(), msl, window)
    return np.asarray(flat, np.int64), np.asarray(bounds, np.int64)


@pytest.mark.parametrize("strategy", ["pack", "bucket", "pad"])
@pytest.mark.parametrize(("n", "msl", "tokens_per_step"), [(3000, 128, 1024), (20_000, 512, 8192)])
def test_build_plan_equals_the_reference_in_every_layout(
    monkeypatch, strategy: str, n: int, msl: int, tokens_per_step: int
) -> None:
    lengths = _lengths("long_tailed", n, msl, 5)
    trained = np.maximum(0, lengths - 1 - np.random.default_rng(6).integers(0, 3, n))
    indices = np.flatnonzero(np.random.default_rng(7).random(n) < 0.9)  # a held-out share
    for epoch, idx in [(0, None), (2, indices)]:
        kw = dict(
            strategy=strategy,
            max_seq_len=msl,
            tokens_per_step=tokens_per_step,
            seed=3,
            epoch=epoch,
            indices=idx,
            trained=trained,
        )
        got = build_plan(lengths, **kw)
        with monkeypatch.context() as m:
            m.setattr(plan_mod, "_fill_rows", _reference_adapter)
            plan_mod.release_step_plans()  # else the shared step plan answers unfilled
            want = build_plan(lengths, **kw)
        plan_mod.release_step_plans()
        for field in ("seqs", "row_bounds", "step_bounds", "row_tokens"):
            assert np.array_equal(getattr(got, field), getattr(want, field)), field
        assert got.n_steps > 1


def test_layouts_and_the_loader_share_one_step_plan(monkeypatch) -> None:
    """`batching: auto` lays out pack, bucket and pad, and the loader plans the same epoch:
    the pass over every document runs once for the same inputs, again for any other."""
    lengths = _lengths("long_tailed", 3000, 256, 8)
    calls = []
    real = plan_mod._fill_rows

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(plan_mod, "_fill_rows", counting)
    plan_mod.release_step_plans()
    kw = dict(max_seq_len=256, tokens_per_step=2048, seed=11, epoch=0)
    plans = {s: build_plan(lengths, strategy=s, **kw) for s in ("pack", "bucket", "pad")}
    assert len(calls) == 1
    again = build_plan(lengths, strategy="pack", **kw)
    assert len(calls) == 1 and np.array_equal(again.seqs, plans["pack"].seqs)
    build_plan(lengths, strategy="pack", **{**kw, "epoch": 1})  # another epoch: planned
    build_plan(lengths + (lengths < 256), strategy="pack", **kw)  # other lengths: planned
    assert len(calls) == 3
    with pytest.raises(ValueError):  # the shared arrays cannot be changed under a layout
        plans["pad"].seqs[0] = 1


def test_the_loader_releases_the_shared_step_plan(tmp_path) -> None:
    """Once the loader has its own plan, the shared step plan (16 bytes per document) goes."""
    from test_batching_support import long_tailed_lengths, make_store

    from pitstop.batching.loader import LoaderOptions, MicroBatchLoader
    from pitstop.batching.settings import BatchSettings

    store = make_store(tmp_path / "s", long_tailed_lengths(300, 64), max_seq_len=64)
    settings = BatchSettings("pack", 64, 256, micro_batch_size=2)
    kw = dict(max_seq_len=64, tokens_per_step=256, seed=0, epoch=0)
    build_plan(store.lengths, strategy="bucket", trained=np.asarray(store.lengths) - 1, **kw)
    assert plan_mod._STEP_PLANS
    loader = MicroBatchLoader(store, settings, LoaderOptions(workers=0))
    assert loader.steps_per_epoch > 1 and not plan_mod._STEP_PLANS


def _fill_chunks(lengths: np.ndarray, msl: int) -> tuple[np.ndarray, np.ndarray]:
    """The fill's rows over `lengths` in the order given: (positions row by row, bounds)."""
    flats, bounds = [np.zeros(0, np.int64)], [np.zeros(1, np.int64)]
    for a, flat, rb in plan_mod._filled(lengths, np.arange(len(lengths)), msl):
        flats.append(flat + a)
        bounds.append(rb[1:] + a)
    return np.concatenate(flats), np.concatenate(bounds)


def test_rows_are_filled_chunk_by_chunk_the_same_in_parallel(monkeypatch) -> None:
    """Past FILL_CHUNK sequences the fill runs per chunk (in processes where there are
    cores): each chunk's rows are exactly its own fill, and the plan does not depend on the
    number of processes."""
    monkeypatch.setattr(plan_mod, "FILL_CHUNK", 1000)
    lengths = _lengths("long_tailed", 4500, 256, 12)
    monkeypatch.setattr(plan_mod, "FILL_WORKERS", 1)
    flat1, bounds1 = _fill_chunks(lengths, 256)
    monkeypatch.setattr(plan_mod, "FILL_WORKERS", 8)
    flat2, bounds2 = _fill_chunks(lengths, 256)
    assert np.array_equal(flat1, flat2) and np.array_equal(bounds1, bounds2)
    want_flat, want_bounds, placed = [], [0], 0
    for a in range(0, 4500, 1000):
        f, b = _fill_rows(lengths[a : a + 1000], 256)
        want_flat += [a + i for i in f]
        want_bounds += [placed + x for x in list(b)[1:]]
        placed += len(f)
    assert flat1.tolist() == want_flat and bounds1.tolist() == want_bounds
    assert sorted(flat1.tolist()) == list(range(4500))  # every sequence once
    rows = np.add.reduceat(lengths[flat1], bounds1[:-1])
    assert rows.max() <= 256
    # one chunk (the plans of up to FILL_CHUNK sequences) is the plain fill, as before
    f, b = _fill_rows(lengths[:1000], 256)
    one_flat, one_bounds = _fill_chunks(lengths[:1000], 256)
    assert one_flat.tolist() == list(f) and one_bounds.tolist() == list(b)


def _fill_in_a_worker_that_ignores_ctrl_c(lengths: np.ndarray, msl: int):
    """The real fill, in a worker that must not run the parent's SIGINT handler (Ctrl-C
    reaches the whole process group; the parent alone stops and prints)."""
    import signal

    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        raise AssertionError(f"a fill worker handles SIGINT: {signal.getsignal(signal.SIGINT)}")
    return _fill_rows(lengths, msl)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fill forks on Linux only")
def test_fill_workers_leave_ctrl_c_to_the_parent(monkeypatch) -> None:
    from pitstop.core.stopping import stop_on_signals

    monkeypatch.setattr(plan_mod, "FILL_CHUNK", 1000)
    monkeypatch.setattr(plan_mod, "FILL_WORKERS", 2)
    monkeypatch.setattr(plan_mod, "_fill_rows", _fill_in_a_worker_that_ignores_ctrl_c)
    lengths = _lengths("long_tailed", 4500, 256, 12)
    with stop_on_signals("the test", "nothing"):  # the handler a forked worker would keep
        flat, _ = _fill_chunks(lengths, 256)
    assert sorted(flat.tolist()) == list(range(4500))


def _a_fill_that_takes_minutes(lengths: np.ndarray, msl: int):
    import time

    time.sleep(600)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fill forks on Linux only")
def test_a_stop_ends_the_fill_workers_at_once(monkeypatch) -> None:
    """Ctrl-C while the workers are on chunks that take minutes: the planner stops at once
    and its workers are ended, not waited for."""
    import os
    import signal
    import threading
    import time

    from pitstop.core.stopping import Stopped, stop_on_signals

    monkeypatch.setattr(plan_mod, "FILL_CHUNK", 1000)
    monkeypatch.setattr(plan_mod, "FILL_WORKERS", 2)
    monkeypatch.setattr(plan_mod, "_fill_rows", _a_fill_that_takes_minutes)
    lengths = _lengths("long_tailed", 4500, 256, 12)
    ctrl_c = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    start = time.monotonic()
    try:
        with pytest.raises(Stopped), stop_on_signals("the test", "nothing"):
            ctrl_c.start()
            _fill_chunks(lengths, 256)
    finally:
        ctrl_c.cancel()  # never a SIGINT to pytest itself, whatever happened above
    assert time.monotonic() - start < 30  # not the 600 s each worker's chunk takes
