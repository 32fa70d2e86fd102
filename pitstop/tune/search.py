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
   far, and wins when it is faster by more than `min_gain` and by more than two
   standard errors of the difference (from the trials' step-time spreads, and
   from how much repeated trials of one setting differ in this run: see `noise`);
   ties keep the earlier choice. Passes repeat while something changes
   and the budget lasts.
4. A win is checked before it is taken: the incumbent and the challenger are
   measured once more each (incumbent first), and the challenger is taken only if
   it wins this fresh pair by the same rule. One lucky trial (a quiet moment on a
   shared machine) therefore cannot steer the search. Every measurement of a
   setting is pooled into its figure (the median over all its steps).
5. Confirmation: when the winner is not the starting configuration, both are
   measured again, side by side (`confirm_rounds` rounds, default 1, alternating
   which goes first; the start first in round 1). Picking the largest of many
   noisy figures favours a lucky one (the winner's curse); figures measured after
   the choice was made, side by side with the start, are not biased that way. If
   the winner does not beat the start there by the same rule as in step 3, the
   starting configuration is kept. The speed-up is the side-by-side ratio; the
   winner's tokens/s is the start's figure over all its trials (spread across the
   tune, so drift in the machine's speed averages out) times that ratio. When the
   start itself wins, it is measured once more at the end for the same reason.

A trial is started only when the time left covers its expected cost (the median
of earlier trials; a first compile trial adds pitstop's compile-time basis) plus
the confirmation's, so the search ends with the best found and a confirmed
figure when the budget runs out, never mid-trial.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from pitstop.measure import cost_model
from pitstop.probe import COMPILE_SECONDS_BASIS
from pitstop.train.oom import is_oom
from pitstop.tune.space import Settings, Space

OK = "ok"
OOM = "oom"
OVER_MEMORY = "over-memory"
COMPILE_FAILED = "compile-failed"
FAILED = "failed"

# Peak memory must stay this share under the limit: the cost model's headroom, so a trial
# fits by the rule the doctor and `pitstop estimate` use (pitstop.measure.cost_model).
DEFAULT_HEADROOM = cost_model.DEFAULT_HEADROOM
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
    # Per measured step (warm-up excluded): seconds and trained tokens, so that several
    # measurements of one setting can be pooled into one median.
    step_times: list[float] = field(default_factory=list)
    step_tokens: list[float] = field(default_factory=list)
    measurements: int = 1  # trials pooled into this figure
    role: str = "search"  # start | search | recheck | confirm (why it ran) | pooled

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["settings"] = self.settings.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrialResult:
        return cls(**{**d, "settings": Settings.from_dict(d["settings"])})


Measure = Callable[[Settings], TrialResult]


def pool(results: list[TrialResult]) -> TrialResult:
    """One figure from several measurements of the same settings.

    With per-step data: tokens/s = mean trained tokens per step / median step time over
    every measured step of every trial (the same rule as one trial). Without (a cost
    model): the mean of the trials' figures. Only fitting measurements are pooled.
    """
    ok = [r for r in results if r.status == OK and r.tokens_per_second]
    if not ok:
        return results[-1]
    if len(ok) == 1:
        return ok[0]
    first = ok[0]
    times = [t for r in ok for t in r.step_times]
    tokens = [t for r in ok for t in r.step_tokens]
    if times and tokens and all(r.step_times for r in ok):
        med = statistics.median(times)
        tps = statistics.fmean(tokens) / med if med > 0 else None
        spread, steps = relative_spread(times), len(times)
    else:
        tps = statistics.fmean(float(r.tokens_per_second or 0) for r in ok)
        med = statistics.fmean(float(r.step_seconds or 0) for r in ok) or None
        spread = max((r.spread for r in ok if r.spread is not None), default=None)
        steps = sum(r.steps for r in ok)
    peaks = [r.peak_memory_bytes for r in ok if r.peak_memory_bytes is not None]
    return dataclasses.replace(
        first,
        tokens_per_second=tps,
        step_seconds=med,
        spread=spread,
        steps=steps,
        peak_memory_bytes=max(peaks) if peaks else None,
        seconds=sum(r.seconds for r in ok),
        cached=all(r.cached for r in ok),
        step_times=times,
        step_tokens=tokens,
        measurements=sum(r.measurements for r in ok),
        role="pooled",
    )


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


class TuneInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stops the whole tune (`commands/tune.py` says what is kept).

    A KeyboardInterrupt, not an Exception: every `except Exception` that turns a trial's
    error into a failed trial (`safe_measure`) lets it through, as it does Ctrl-C.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class StopRequest:
    """The signal that asked the tune to stop (None: none), kept past the exception.

    The handler raises TuneInterrupted where the main thread is; when that is inside a
    `__del__` or a callback whose exceptions are ignored (tqdm's), the exception is
    lost, and the next trial (`safe_measure`) or the tune's end raises it again.
    """

    signum: int | None = None

    @classmethod
    def check(cls) -> None:
        if cls.signum is not None:
            raise TuneInterrupted(cls.signum)


def safe_measure(measure: Measure, settings: Settings) -> TrialResult:
    """Run one trial; an out-of-memory error becomes status 'oom', any other error 'failed'."""
    StopRequest.check()
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
    """Every trial in order, the start and the winner, and why the search stopped.

    `trials` holds every measurement (search, recheck and confirmation trials);
    `baseline` and `best` are pooled figures: from the confirmation trials when the
    winner differs from the start, else from every measurement of the start.
    """

    trials: list[TrialResult]
    baseline: TrialResult
    best: TrialResult | None
    stopped: str  # converged | budget | nothing-fits
    elapsed_seconds: float
    memory_limit_bytes: int | None = None
    # None: no confirmation was needed (the start won, or did not fit); True: the winner
    # beat the start again side by side; False: it did not, and the start was kept.
    confirmed: bool | None = None
    rejected: TrialResult | None = None  # the search's winner the confirmation turned down
    trial_noise: float = 0.0  # trial-to-trial relative SD measured in this run (0: unknown)

    @property
    def speedup(self) -> float | None:
        """Best over baseline tokens/s, both measured in this run (None if either is missing)."""
        b, w = self.baseline, self.best
        if b.status != OK or w is None or not b.tokens_per_second or not w.tokens_per_second:
            return None
        return w.tokens_per_second / b.tokens_per_second


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
    confirm_rounds: int = 1,
    log: Callable[[TrialResult], None] | None = None,
) -> SearchResult:
    """Find the fastest settings that fit; see the module docstring for the strategy.

    `start` is the user's configuration, measured here unless a TrialResult is given
    (the CLI measures it itself, as the user wrote it). `cache` (a `TrialCache`) lets
    trials measured by an earlier tune be reused; the figures reported for the start
    and the winner are always measured in this run, so the speed-up compares like with
    like.
    """
    return Search(
        space,
        measure,
        budget_seconds=budget_seconds,
        memory_limit_bytes=memory_limit_bytes,
        headroom=headroom,
        min_gain=min_gain,
        cache=cache,
        clock=clock,
        compile_estimate_seconds=(
            COMPILE_SECONDS_BASIS if compile_estimate_seconds is None else compile_estimate_seconds
        ),
        max_passes=max_passes,
        confirm_rounds=confirm_rounds,
        log=log,
    ).run(start)


def fits(r: TrialResult | None) -> bool:
    """Whether a trial ran, fit in memory and has a figure."""
    return r is not None and r.status == OK and r.tokens_per_second is not None


class Search:
    """One search: its trials so far, the best fitting figure, and the budget left.

    `run` goes through the module docstring's stages in order: `measure_start` (1),
    `micro_batch` (2), `descend` (3, each win checked by `adopt`: 4) and `confirm` (5).
    `trial` is the one place a setting is measured; once the budget cannot cover a
    trial, it sets `exhausted` and every later search trial is refused, so the stages
    stop where they are and the confirmation (whose time was reserved) still runs.
    """

    def __init__(
        self,
        space: Space,
        measure: Measure,
        *,
        budget_seconds: float,
        memory_limit_bytes: int | None,
        headroom: float,
        min_gain: float,
        cache: Any,
        clock: Callable[[], float],
        compile_estimate_seconds: float,
        max_passes: int,
        confirm_rounds: int,
        log: Callable[[TrialResult], None] | None,
    ) -> None:
        self.space, self.measure, self.cache, self.clock, self.log = (
            space,
            measure,
            cache,
            clock,
            log,
        )
        self.budget_seconds, self.limit = budget_seconds, memory_limit_bytes
        self.headroom, self.min_gain = headroom, min_gain
        self.compile_estimate_seconds = compile_estimate_seconds
        self.max_passes, self.confirm_rounds = max_passes, confirm_rounds
        self.t0 = clock()
        self.trials: list[TrialResult] = []
        self.history: dict[Settings, list[TrialResult]] = {}
        self.baseline: TrialResult | None = None
        self.best: TrialResult | None = None
        self.out_of_budget = False  # some trial was skipped for lack of time
        self.exhausted = False  # not even a cheap trial fits the time left: search over

    # --- the stages ---------------------------------------------------------------------

    def run(self, start: Settings | TrialResult) -> SearchResult:
        baseline = self.measure_start(start)
        self.best = baseline if fits(baseline) else None
        self.micro_batch(baseline)
        if self.best is not None:
            self.descend()
        return self.confirm(baseline)

    def measure_start(self, start: Settings | TrialResult) -> TrialResult:
        """Stage 1: the user's configuration, measured fresh (or as the caller measured it)."""
        if isinstance(start, TrialResult):
            self.t0 -= start.seconds  # the caller's baseline trial spent the budget too
            baseline = self.judge(start)
            baseline.role = "start"
            self.record(baseline)
        else:
            baseline = self.trial(start, fresh=True, force=True, role="start")  # type: ignore[assignment]
        self.baseline = baseline
        return baseline

    def micro_batch(self, baseline: TrialResult) -> None:
        """Stage 2: the micro-batch ladder; updates `self.best`."""
        space = self.space
        if not space.tune_micro_batch:
            return
        ladder = space.micro_ladder()
        start = baseline.settings
        if self.best is None:
            # The start does not fit (or failed): the largest smaller micro-batch that does.
            for m in [m for m in reversed(ladder) if m < start.micro_rows]:
                r = self.trial(start.replace(micro_rows=m))
                if fits(r):
                    self.best = r
                    break
            if (
                self.best is None
                and space.gradient_checkpointing
                and not start.gradient_checkpointing
            ):
                ckpt = start.replace(gradient_checkpointing=True)
                for m in ladder:
                    r = self.trial(ckpt.replace(micro_rows=m))
                    if not fits(r):
                        break
                    self.take(r)
                return
            if self.best is None:
                return
        no_gain = 0
        for m in [m for m in ladder if m > self.best.settings.micro_rows]:
            r = self.trial(self.best.settings.replace(micro_rows=m))
            if not fits(r):
                break  # larger micro-batches need more memory still
            if self.take(r):
                no_gain = 0
            else:
                no_gain += 1
                if no_gain >= 2:
                    break
        if self.best.settings == start and start.micro_rows > 1:
            # Bigger did not help (common on CPUs, where cache size rules): try one rung down.
            down = max(m for m in ladder if m < start.micro_rows)
            self.take(self.trial(start.replace(micro_rows=down)))

    def descend(self) -> None:
        """Stage 3: coordinate descent, passes repeated while something changes."""
        assert self.best is not None
        for _ in range(self.max_passes):
            changed = False
            for name, values in self.space.coordinates():
                if name == "prefetch_factor" and self.best.settings.loader_workers == 0:
                    continue  # prefetching needs worker processes
                for v in values:
                    if v != getattr(self.best.settings, name):
                        changed |= self.take(self.trial(self.best.settings.replace(**{name: v})))
            if self.space.tune_micro_batch:
                # a new strategy or kernel can move the best micro-batch by one rung
                ladder = self.space.micro_ladder()
                m = self.best.settings.micro_rows
                i = ladder.index(m) if m in ladder else -1
                for j in (i - 1, i + 1):
                    if i >= 0 and 0 <= j < len(ladder):
                        changed |= self.take(
                            self.trial(self.best.settings.replace(micro_rows=ladder[j]))
                        )
            if not changed or self.exhausted:
                break

    def take(self, r: TrialResult | None) -> bool:
        """Make `r` the best if `adopt` accepts it; whether it did."""
        won = self.adopt(r, self.best)
        if won is not None:
            self.best = won
        return won is not None

    def adopt(self, r: TrialResult | None, best: TrialResult | None) -> TrialResult | None:
        """Stage 4: `r`'s pooled figure if it beats `best`, checked by a second measurement
        of each."""
        if not self.better(r, best):
            return None
        if best is None:
            return r
        c, b = self.figure(r.settings), self.figure(best.settings)  # type: ignore[union-attr]
        if c.measurements >= 2:  # checked before (a pooled figure from the cache)
            return c
        # The challenger was picked *because* it measured fast, so the decision rests on a
        # fresh pair measured side by side, the incumbent first (the order alternates with
        # the challenger's first trial). No time for it (a compile trial over budget): the
        # change is not taken.
        rb = self.trial(b.settings, fresh=True, role="recheck")
        rc = self.trial(c.settings, fresh=True, role="recheck") if rb is not None else None
        if rb is None or rc is None:
            return None
        pair_won = self.better(self.history[c.settings][-1], self.history[b.settings][-1])
        c, b = self.figure(c.settings), self.figure(b.settings)
        if self.cache is not None:
            self.cache.put(c)  # pooled: a later tune need not check it again
            self.cache.put(b)
        self.best = b  # the incumbent's figure may have moved
        return c if pair_won else None

    def confirm(self, baseline: TrialResult) -> SearchResult:
        """Stage 5: the winner against the start, side by side; the result."""
        stopped = "budget" if self.out_of_budget else "converged"
        best = self.best
        confirmed: bool | None = None
        rejected: TrialResult | None = None
        if best is None:
            stopped = "nothing-fits"
        elif fits(baseline) and best.settings != baseline.settings:
            if self.confirm_rounds > 0:
                pair = [best.settings, baseline.settings]
                for i in range(self.confirm_rounds):
                    for s in pair if i % 2 else pair[::-1]:  # the start first in round 1
                        self.trial(s, fresh=True, force=True, role="confirm")
                if self.cache is not None:
                    self.cache.put(self.figure(best.settings))
                base_c, best_c = (
                    pool([t for t in self.history[s] if t.role == "confirm"])
                    for s in (baseline.settings, best.settings)
                )
                if not fits(base_c):  # the start failed this time: its earlier figures stand
                    base_c = self.figure(baseline.settings)
                level = self.figure(baseline.settings)  # every measurement of the start
                baseline = level
                if fits(best_c) and self.better(best_c, base_c):
                    best, confirmed = _scaled(best_c, level, base_c), True
                else:
                    rejected, best, confirmed = best_c, level, False
            else:
                baseline = self.figure(baseline.settings)
        elif fits(baseline):
            # The start won: measure it once more at the end (time allowing; the
            # confirmation's reserve covers it), so its figure pools trials from both ends
            # of the tune and drift in the machine's speed averages out instead of
            # deciding the figure.
            if (
                self.confirm_rounds > 0
                and self.elapsed() + self.expected_cost(baseline.settings) <= self.budget_seconds
            ):
                self.trial(baseline.settings, fresh=True, force=True, role="confirm")
            baseline = best = self.figure(baseline.settings)
        elif best.cached:
            # A number from an earlier tune is not a measurement of this run: measure again.
            fresh = self.trial(best.settings, fresh=True, force=True, role="confirm")
            if fits(fresh):
                best = pool([t for t in self.history[best.settings] if not t.cached])
        return SearchResult(
            self.trials,
            baseline,
            best,
            stopped,
            self.elapsed(),
            self.limit,
            confirmed,
            rejected,
            self.between(),
        )

    # --- measuring ----------------------------------------------------------------------

    def trial(
        self, s: Settings, *, fresh: bool = False, force: bool = False, role: str = "search"
    ) -> TrialResult | None:
        """The figure of `s`: pooled from this run, from the cache, or measured now. None
        when the time left does not cover it (`force`: the start and the confirmation,
        whose time is reserved, run regardless)."""
        if self.exhausted and not force:
            return None
        if s in self.history and not fresh:
            return self.figure(s)
        if self.cache is not None and not fresh:
            hit = self.cache.get(s)
            if hit is not None:
                hit.cached = True
                return self.record(self.judge(hit))
        if (
            not force
            and self.elapsed() + self.expected_cost(s) + self.reserve(s) > self.budget_seconds
        ):
            self.out_of_budget = True
            # A compile trial is dearer; cheaper ones may still fit. Any other: search over.
            self.exhausted = not s.compile
            return None
        t = self.clock()
        r = self.judge(safe_measure(self.measure, s))
        r.seconds = r.seconds or (self.clock() - t)
        r.role = role
        if self.cache is not None and role in ("search", "start"):
            self.cache.put(r)
        return self.record(r)

    def record(self, r: TrialResult) -> TrialResult:
        self.trials.append(r)
        self.history.setdefault(r.settings, []).append(r)
        if self.log is not None:
            self.log(r)
        return self.figure(r.settings)

    def judge(self, r: TrialResult) -> TrialResult:
        """Mark a fitting trial over the memory limit (minus headroom) as over-memory."""
        limit = self.limit
        if (
            r.status == OK
            and limit is not None
            and r.peak_memory_bytes is not None
            and r.peak_memory_bytes > (1 - self.headroom) * limit
        ):
            r.status = OVER_MEMORY
            r.error = (
                f"peak {r.peak_memory_bytes / 2**30:.2f} GiB is above the limit "
                f"{limit / 2**30:.2f} GiB minus {self.headroom:.0%} headroom"
            )
        return r

    def figure(self, s: Settings) -> TrialResult:
        """Every measurement of `s` so far, pooled."""
        return pool(self.history[s])

    def better(self, r: TrialResult | None, best: TrialResult | None) -> bool:
        if not fits(r):
            return False
        if best is None:
            return True
        margin = max(self.min_gain, 2 * noise(r, best, self.between()))  # type: ignore[arg-type]
        return r.tokens_per_second > best.tokens_per_second * (1 + margin)  # type: ignore[union-attr,operator]

    def between(self) -> float:
        """Trial-to-trial noise measured in this run (see `trial_to_trial_noise`)."""
        return trial_to_trial_noise(
            [[t for t in ts if fits(t) and not t.cached] for ts in self.history.values()]
        )

    # --- the budget ---------------------------------------------------------------------

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def expected_cost(self, s: Settings) -> float:
        done = [t.seconds for t in self.trials if not t.cached and t.seconds > 0]
        base = statistics.median(done) if done else 0.0
        compiled = [t.seconds for t in self.trials if t.settings.compile and not t.cached]
        if s.compile and not compiled:
            return base + self.compile_estimate_seconds
        return max(base, statistics.median(compiled)) if s.compile and compiled else base

    def reserve(self, s: Settings) -> float:
        """Time kept for the confirmation, should `s` (or the best so far) win."""
        if not self.confirm_rounds or not fits(self.baseline):
            return 0.0
        assert self.baseline is not None
        cand = max(
            self.expected_cost(s), self.expected_cost(self.best.settings) if self.best else 0.0
        )
        return self.confirm_rounds * (self.expected_cost(self.baseline.settings) + cand)


def _scaled(best_c: TrialResult, level: TrialResult, base_c: TrialResult) -> TrialResult:
    """The winner's figure: the start's level times the side-by-side ratio.

    The machine's speed drifts (on a shared host by 20% within minutes), so one round
    says little about the level but much about the ratio of two settings measured
    back to back. The start's figure pools every one of its trials across the whole
    tune (it was fixed before any choice, so no selection bias); the ratio comes from
    the confirmation round only. Both raw side-by-side figures stay in `extra`.
    """
    ratio = float(best_c.tokens_per_second) / float(base_c.tokens_per_second)  # type: ignore[arg-type]
    scale = float(level.tokens_per_second) / float(base_c.tokens_per_second)  # type: ignore[arg-type]
    return dataclasses.replace(
        best_c,
        tokens_per_second=float(best_c.tokens_per_second) * scale,  # = level x ratio
        step_seconds=best_c.step_seconds / scale if best_c.step_seconds else None,
        role="pooled",
        extra={
            **best_c.extra,
            "side_by_side": {
                "tokens_per_second": best_c.tokens_per_second,
                "start_tokens_per_second": base_c.tokens_per_second,
                "ratio": ratio,
                "start_level_tokens_per_second": level.tokens_per_second,
                "start_measurements": level.measurements,
            },
        },
    )


def median_standard_error(r: TrialResult) -> float:
    """Relative standard error of a trial's median step time, from its p10-p90 spread.

    For normal noise p90 - p10 = 2.563 sigma and the median's standard error is about
    1.253 sigma / sqrt(n). Zero when the trial reports no spread (a cost model).
    """
    if not r.spread or r.steps < 2:
        return 0.0
    return 1.253 * (r.spread / 2.563) / math.sqrt(r.steps)


def noise(a: TrialResult, b: TrialResult, between: float = 0.0) -> float:
    """Relative standard error of the ratio of two figures.

    Each figure's error has two parts: within its trials (the median's standard error
    from the step-time spread) and between trials (`between`: how much one trial of
    the same settings differs from the next on this machine, shrinking with the
    number of trials pooled). A shared host drifts by several percent between trials
    even when every trial's steps are steady, so the within part alone is too hopeful.
    """

    def se(r: TrialResult) -> float:
        return math.hypot(median_standard_error(r), between / math.sqrt(max(1, r.measurements)))

    return math.hypot(se(a), se(b))


def trial_to_trial_noise(groups: list[list[TrialResult]]) -> float:
    """Relative standard deviation of one trial's figure, from repeated settings.

    Each group holds the measurements of one setting; the pooled within-group
    variance of log tokens/s (degrees of freedom: measurements minus groups) is the
    trial-to-trial noise of this machine in this run. 0 until a setting has been
    measured twice.
    """
    logs = [
        [math.log(float(t.tokens_per_second)) for t in g if t.tokens_per_second] for g in groups
    ]
    logs = [g for g in logs if len(g) >= 2]
    dof = sum(len(g) for g in logs) - len(logs)
    if dof < 1:
        return 0.0
    ss = sum(sum((x - statistics.fmean(g)) ** 2 for x in g) for g in logs)
    return math.sqrt(ss / dof)


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
