"""The search: coordinate descent over the knobs of a `Space`, within a time budget.

The search only sees `measure(settings) -> TrialResult` (the real one runs training
steps, see `pitstop.tune.trial`; tests pass a deterministic cost model), so its logic
is testable without a model.

Order of work, most decisive first:

1. The starting configuration (the user's) is measured first, always fresh: it is
   the reference for the speed-up.
2. Micro-batch size: doubling from the start value until a trial does not fit
   (CUDA out of memory, or peak memory above the limit minus 10% headroom) or two
   doublings in a row bring nothing. When the start does not fit, halve until one
   does; when even one row per micro-batch does not fit, turn gradient
   checkpointing on (the only case it is tried: it costs ~1/3 more compute) and
   climb again.
3. Coordinate descent over batching, compile, attention, loader workers and
   prefetch: each alternative value is tried with everything else at the best so
   far, and kept when it is faster by more than `min_gain` and by more than two
   standard errors of the difference (estimated from each trial's step-time
   spread), so measurement noise on a busy machine does not pick the winner; ties
   keep the earlier choice. Passes repeat while something changes
   and the budget lasts.

A trial is started only when the time left covers its expected cost (the median
of earlier trials; a first compile trial adds pitstop's compile-time basis), so
the search ends with the best found when the budget runs out, never mid-trial.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from pitstop.tune.space import Settings, Space

OK = "ok"
OOM = "oom"
OVER_MEMORY = "over-memory"
COMPILE_FAILED = "compile-failed"
FAILED = "failed"

DEFAULT_HEADROOM = 0.10  # peak memory must stay 10% under the limit
DEFAULT_MIN_GAIN = 0.02  # a change must win by more than 2% to replace the best


@dataclass
class TrialResult:
    """One measured configuration. Times in seconds; tokens are trained (loss-carrying) tokens."""

    settings: Settings
    status: str = OK
    tokens_per_second: float | None = None
    step_seconds: float | None = None  # median over the measured steps
    spread: float | None = None  # (p90 - p10) / median of the measured steps
    steps: int = 0  # measured steps (warm-up excluded)
    warmup_seconds: float = 0.0  # warm-up steps, reported, never in tokens_per_second
    compile_seconds: float | None = None  # warm-up time above steady steps, with compile on
    setup_seconds: float = 0.0  # model load, loader start, `batching: auto` timing
    peak_memory_bytes: int | None = None
    tokens_per_step: int | None = None  # the training math this trial ran with
    seconds: float = 0.0  # wall time the trial took (what the budget is spent on)
    cached: bool = False
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["settings"] = self.settings.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrialResult:
        return cls(**{**d, "settings": Settings.from_dict(d["settings"])})


Measure = Callable[[Settings], TrialResult]


def is_oom(exc: BaseException) -> bool:
    """Whether an exception (or one it wraps) is an out-of-memory error."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, MemoryError):
            return True
        try:
            import torch

            if isinstance(e, torch.cuda.OutOfMemoryError):
                return True
        except (ImportError, AttributeError):
            pass
        if isinstance(e, RuntimeError) and "out of memory" in str(e).lower():
            return True
        e = e.__cause__ or e.__context__
    return False


def free_memory() -> None:
    """Give back what a failed or finished trial held: Python garbage, CUDA cache, heap."""
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass
    try:  # glibc keeps freed heap pages; returning them makes the next peak RSS honest
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def safe_measure(measure: Measure, settings: Settings) -> TrialResult:
    """Run one trial; an out-of-memory error becomes status 'oom', any other error 'failed'."""
    try:
        return measure(settings)
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:
        oom = is_oom(e)
        msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        # Leaving the except block drops the traceback (and the frames holding the
        # failed trial's model and optimizer), so the memory can actually be freed.
    free_memory()
    return TrialResult(settings, status=OOM if oom else FAILED, error=msg)


@dataclass
class SearchResult:
    """Every trial in order, the reference and the winner, and why the search stopped."""

    trials: list[TrialResult]
    baseline: TrialResult
    best: TrialResult | None
    stopped: str  # converged | budget | nothing-fits
    elapsed_seconds: float
    memory_limit_bytes: int | None = None

    @property
    def speedup(self) -> float | None:
        """Best over baseline tokens/s, both measured in this run (None if either is missing)."""
        b, w = self.baseline, self.best
        if b.status != OK or w is None or not b.tokens_per_second or not w.tokens_per_second:
            return None
        return w.tokens_per_second / b.tokens_per_second


class _Budget(Exception):
    """No time left for any further trial."""


def search(
    space: Space,
    measure: Measure,
    *,
    start: Settings | TrialResult,
    budget_seconds: float,
    memory_limit_bytes: int | None = None,
    headroom: float = DEFAULT_HEADROOM,
    min_gain: float = DEFAULT_MIN_GAIN,
    cache: Any = None,
    clock: Callable[[], float] = time.monotonic,
    compile_estimate_seconds: float | None = None,
    max_passes: int = 3,
    log: Callable[[TrialResult], None] | None = None,
) -> SearchResult:
    """Find the fastest settings that fit; see the module docstring for the strategy.

    `start` is the user's configuration, measured here unless a TrialResult is given
    (the CLI measures it itself, as the user wrote it). `cache` (a `TrialCache`) lets
    trials measured by an earlier tune be reused; the baseline and the winner are
    always measured in this run, so the speed-up compares like with like.
    """
    t0 = clock()
    if isinstance(start, TrialResult):
        t0 -= start.seconds  # the caller's baseline trial spent the budget too
    trials: list[TrialResult] = []
    seen: dict[Settings, TrialResult] = {}
    limit = memory_limit_bytes
    out_of_budget = False
    if compile_estimate_seconds is None:
        from pitstop.probe import COMPILE_SECONDS_BASIS

        compile_estimate_seconds = COMPILE_SECONDS_BASIS

    def fits(r: TrialResult) -> bool:
        return r.status == OK and r.tokens_per_second is not None

    def judge(r: TrialResult) -> TrialResult:
        if (
            r.status == OK
            and limit is not None
            and r.peak_memory_bytes is not None
            and r.peak_memory_bytes > (1 - headroom) * limit
        ):
            r.status = OVER_MEMORY
            r.error = (
                f"peak {r.peak_memory_bytes / 2**30:.2f} GiB is above the limit "
                f"{limit / 2**30:.2f} GiB minus {headroom:.0%} headroom"
            )
        return r

    def expected_cost(s: Settings) -> float:
        done = [t.seconds for t in trials if not t.cached and t.seconds > 0]
        base = statistics.median(done) if done else 0.0
        compiled = [t.seconds for t in trials if t.settings.compile and not t.cached]
        if s.compile and not compiled:
            return base + compile_estimate_seconds
        return max(base, statistics.median(compiled)) if s.compile and compiled else base

    def run(s: Settings, *, fresh: bool = False, force: bool = False) -> TrialResult | None:
        nonlocal out_of_budget
        if s in seen and not fresh:
            return seen[s]
        if cache is not None and not fresh:
            hit = cache.get(s)
            if hit is not None:
                hit.cached = True
                return record(judge(hit))
        if not force and clock() - t0 + expected_cost(s) > budget_seconds:
            if not s.compile:
                out_of_budget = True
                raise _Budget
            out_of_budget = True  # a compile trial is dearer; cheaper ones may still fit
            return None
        t = clock()
        r = judge(safe_measure(measure, s))
        r.seconds = r.seconds or (clock() - t)
        if cache is not None and r.status in (OK, OOM, OVER_MEMORY, COMPILE_FAILED):
            cache.put(r)
        return record(r)

    def record(r: TrialResult) -> TrialResult:
        trials.append(r)
        seen[r.settings] = r
        if log is not None:
            log(r)
        return r

    def better(r: TrialResult | None, best: TrialResult | None) -> bool:
        if r is None or not fits(r):
            return False
        if best is None:
            return True
        margin = max(min_gain, 2 * noise(r, best))
        return r.tokens_per_second > best.tokens_per_second * (1 + margin)  # type: ignore[operator]

    if isinstance(start, TrialResult):
        baseline = judge(start)
        record(baseline)
    else:
        baseline = run(start, fresh=True, force=True)  # type: ignore[assignment]
    state = _Best(baseline if fits(baseline) else None)
    stopped = "converged"
    try:
        _micro_batch(space, baseline, state, run, better, fits)
        best = state.best
        if best is not None:
            for _ in range(max_passes):
                changed = False
                for name, values in space.coordinates():
                    if name == "prefetch_factor" and best.settings.loader_workers == 0:
                        continue  # prefetching needs worker processes
                    for v in values:
                        if v == getattr(best.settings, name):
                            continue
                        r = run(best.settings.replace(**{name: v}))
                        if better(r, best):
                            best = state.best = r
                            changed = True
                if space.tune_micro_batch:
                    # a new strategy or kernel can move the best micro-batch by one rung
                    ladder = space.micro_ladder()
                    i = (
                        ladder.index(best.settings.micro_rows)
                        if best.settings.micro_rows in ladder
                        else -1
                    )
                    for j in (i - 1, i + 1):
                        if i >= 0 and 0 <= j < len(ladder):
                            r = run(best.settings.replace(micro_rows=ladder[j]))
                            if better(r, best):
                                best = state.best = r
                                changed = True
                if not changed:
                    break
    except _Budget:
        pass
    best = state.best
    if out_of_budget:
        stopped = "budget"
    if best is None:
        stopped = "nothing-fits"
    elif best.cached:
        # A number from an earlier tune is not a measurement of this run: measure again.
        fresh = run(best.settings, fresh=True, force=True)
        if fresh is not None and fits(fresh):
            best = fresh
    return SearchResult(trials, baseline, best, stopped, clock() - t0, limit)


@dataclass
class _Best:
    """The best fitting trial so far, shared with helpers so a budget stop keeps it."""

    best: TrialResult | None


def _micro_batch(
    space: Space,
    baseline: TrialResult,
    state: _Best,
    run: Callable[..., TrialResult | None],
    better: Callable[[TrialResult | None, TrialResult | None], bool],
    fits: Callable[[TrialResult], bool],
) -> None:
    """The micro-batch ladder (step 2 of the module docstring); updates `state.best`."""
    if not space.tune_micro_batch:
        return
    ladder = space.micro_ladder()
    start = baseline.settings
    if state.best is None:
        # The start does not fit (or failed): the largest smaller micro-batch that does.
        for m in [m for m in reversed(ladder) if m < start.micro_rows]:
            r = run(start.replace(micro_rows=m))
            if r is not None and fits(r):
                state.best = r
                break
        if state.best is None and space.gradient_checkpointing and not start.gradient_checkpointing:
            ckpt = start.replace(gradient_checkpointing=True)
            for m in ladder:
                r = run(ckpt.replace(micro_rows=m))
                if r is None or not fits(r):
                    break
                if better(r, state.best):
                    state.best = r
            return
        if state.best is None:
            return
    no_gain = 0
    for m in [m for m in ladder if m > state.best.settings.micro_rows]:
        r = run(state.best.settings.replace(micro_rows=m))
        if r is None or not fits(r):
            break  # larger micro-batches need more memory still
        if better(r, state.best):
            state.best, no_gain = r, 0
        else:
            no_gain += 1
            if no_gain >= 2:
                break
    if state.best is baseline and start.micro_rows > 1:
        # Bigger did not help (common on CPUs, where cache size rules): try one rung down.
        down = max(m for m in ladder if m < start.micro_rows)
        r = run(start.replace(micro_rows=down))
        if better(r, state.best):
            state.best = r


def median_standard_error(r: TrialResult) -> float:
    """Relative standard error of a trial's median step time, from its p10-p90 spread.

    For normal noise p90 - p10 = 2.563 sigma and the median's standard error is about
    1.253 sigma / sqrt(n). Zero when the trial reports no spread (a cost model).
    """
    if not r.spread or r.steps < 2:
        return 0.0
    return 1.253 * (r.spread / 2.563) / math.sqrt(r.steps)


def noise(a: TrialResult, b: TrialResult) -> float:
    """Relative standard error of the ratio of two trials' figures."""
    return math.hypot(median_standard_error(a), median_standard_error(b))


def relative_spread(values: list[float]) -> float:
    """(p90 - p10) / median, 0 for fewer than two values."""
    if len(values) < 2:
        return 0.0
    v = sorted(values)

    def q(p: float) -> float:
        x = p * (len(v) - 1)
        lo, hi = math.floor(x), math.ceil(x)
        return v[lo] + (v[hi] - v[lo]) * (x - lo)

    med = q(0.5)
    return (q(0.9) - q(0.1)) / med if med > 0 else 0.0
