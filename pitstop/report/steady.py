"""Steady throughput of a run, and the noise band of a ratio between two runs.

Per run (from metrics.jsonl, one line per optimizer step):

- warm-up: the steps the run marks `"warmup": true` (PitstopCallback, `pitstop profile`),
  else the first `DEFAULT_WARMUP` step(s), are left out; the comparison says how many;
- step seconds: the line's `step_seconds` (else its phases' sum); trained tokens of the
  step: `step_trained_tokens` (else the difference of the cumulative `trained_tokens`);
- steady tokens/s: the trained tokens of the steady steps over their seconds (total over
  total). A median of per-step rates would leave out real stalls that recur: a loader with
  N workers makes every Nth step wait, and those waits are part of what the run costs.
  Only the warm-up is left out. Steady step time: the steady seconds over the steps;
- spread: the coefficient of variation of the rates of consecutive blocks of steady steps
  (`blocks`, about √n steps each; when the step times repeat with a period, `period`, each
  block holds whole periods, so a stall that recurs every few steps is in every block alike).

The noise band of a ratio B/A comes from the same blocks: each run's throughput has a
relative standard error of about sd(block rates) / mean / √blocks (batch means); the
band is exp(±Z·√(seA² + seB²)) around 1 (a ratio's band, never below zero), never
narrower than ±NOISE_FLOOR (±NOISY_FLOOR when either run is flagged noisy: the spread
within a run does not see a load that slowed all of it). A ratio inside the band is "no
measurable difference". These constants are pitstop's choices, named here so the docs
can quote them.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from pitstop.measure.machine import loaded_by_average, shared_by_others
from pitstop.report.runs import LoadedRun

# Steps left out when the run does not mark its warm-up: a process's first steps create
# kernels for each new shape, grow the allocator's pools and run torch.compile.
DEFAULT_WARMUP = 2
MIN_STEADY_STEPS = 3  # fewer steady steps than this: no steady figures, no band
Z = 2.0  # band half-width in standard errors (about 95% for a normal error)
NOISE_FLOOR = 0.02  # ±2%: timer resolution and run-to-run variation on a quiet machine
NOISY_FLOOR = 0.05  # ±5% when a run is flagged noisy (its spread or the machine's load)
NOISY_SPREAD = 0.25  # block rates' coefficient of variation above this flags a run as noisy
# Step times whose autocorrelation at some lag reaches this repeat with that period: the
# blocks then hold whole periods (a stall every 4th step: blocks of 4, 8, 12 ... steps).
PERIODIC_ACF = 0.5


@dataclass
class Steady:
    """The steady-state figures of one run."""

    steps: int  # steady steps the figures use
    warmup: int  # steps left out at the start
    step_seconds: float  # mean: the steady steps' seconds / their number
    tokens_per_second: float | None  # the steady steps' trained tokens / their seconds
    spread: float  # coefficient of variation of the block rates
    rel_se: float  # relative standard error of the steady rate (batch means)
    blocks: int = 1  # consecutive blocks of steps the spread and the error come from
    noisy: list[str] = field(default_factory=list)  # why the run counts as noisy (empty: quiet)


T = TypeVar("T")


def split_warmup(
    steps: list[T], marked: Callable[[T], bool], min_steady: int = MIN_STEADY_STEPS
) -> tuple[list[T], list[T]]:
    """(warm-up steps, steady steps) of a run's steps in order: the steps the run marks as
    warm-up (PitstopCallback, `pitstop profile`), else the first DEFAULT_WARMUP, fewer when
    that would leave under `min_steady`. The one answer `compare` and `estimate` both use."""
    if any(marked(s) for s in steps):
        return [s for s in steps if marked(s)], [s for s in steps if not marked(s)]
    k = min(DEFAULT_WARMUP, max(0, len(steps) - min_steady))
    return steps[:k], steps[k:]


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        return None
    return float(v)


def step_table(run: LoadedRun) -> list[tuple[bool, float, float | None]]:
    """(warm-up?, seconds, trained tokens or None) of each step line with a duration."""
    out = []
    prev_cum: float | None = 0.0
    for r in run.steps:
        secs = _num(r.seconds)
        toks = _num(r.step_trained_tokens)
        cum = _num(r.trained_tokens)
        if toks is None and cum is not None and prev_cum is not None:
            toks = cum - prev_cum
        prev_cum = cum
        if secs is None or secs <= 0:
            continue
        rate = _num(r.tokens_per_second)
        if toks is None and rate is not None:
            toks = rate * secs
        out.append((r.warmup is True, secs, toks))
    return out


def steady_lines(run: LoadedRun) -> list[Any]:
    """The run's step lines in its steady window (the same split as `steady`), for figures
    that must cover the same steps as the throughput (e.g. the data-wait share)."""
    timed = [r for r in run.steps if (_num(r.seconds) or 0) > 0]
    return split_warmup(timed, lambda r: r.warmup is True)[1]


def period(secs: list[float]) -> int:
    """The steps after which the step times repeat (a loader with N workers stalls every
    Nth step): the lag from 2 to n/4 with the highest autocorrelation, when that is at least
    PERIODIC_ACF; else 1 (no pattern)."""
    n = len(secs)
    if n < 8:
        return 1
    dev = np.asarray(secs, dtype=np.float64)
    dev -= dev.mean()
    var = float(dev @ dev)
    if var <= 0:
        return 1
    # One dot product per lag (numpy): a run of 20,000 steps is read in milliseconds.
    acf = np.array([dev[:-k] @ dev[k:] for k in range(2, n // 4 + 1)]) / var
    k = int(np.argmax(acf))
    return k + 2 if acf[k] > PERIODIC_ACF else 1


def blocks(n: int, every: int = 1) -> list[tuple[int, int]]:
    """[start, end) of consecutive blocks of n steps, about ⌊√n⌋ steps each. With a period
    (`every` > 1) each block holds whole periods, so each holds the same stalls; the steps
    past the last whole block are left out of the blocks (never out of the throughput).
    Without one, the blocks tile the n steps (the last ones one longer where n does not
    divide)."""
    if n <= 0:
        return []
    size = max(1, math.isqrt(n))
    if every > 1:
        size = every * max(1, round(size / every))
        k = n // size
        return [(i * size, (i + 1) * size) for i in range(k)] if k > 1 else [(0, n)]
    k = max(1, n // size)
    cuts = [round(i * n / k) for i in range(k + 1)]
    return list(itertools.pairwise(cuts))


def rate_error(secs: list[float], toks: list[float] | None) -> tuple[float, float, int]:
    """(spread, relative standard error, blocks) of a steady rate from its block rates:
    tokens/s of each block where tokens are known, else steps/s."""
    rates = []
    for a, b in blocks(len(secs), period(secs)):
        s = sum(secs[a:b])
        rates.append((sum(toks[a:b]) if toks is not None else b - a) / s)
    mean = statistics.fmean(rates)
    if len(rates) < 2 or mean <= 0:
        return 0.0, 0.0, len(rates)
    cv = statistics.stdev(rates) / mean
    return cv, cv / math.sqrt(len(rates)), len(rates)


def steady(run: LoadedRun) -> Steady | None:
    """The run's steady figures, or None with fewer than MIN_STEADY_STEPS steady steps."""
    warm_rows, rest = split_warmup(step_table(run), lambda row: row[0])
    if len(rest) < MIN_STEADY_STEPS:
        return None
    secs = [s for _, s, _ in rest]
    known = [t for _, _, t in rest if t is not None]
    toks = known if len(known) == len(rest) else None
    total = sum(secs)
    tps = sum(toks) / total if toks is not None else None
    spread, rel_se, k = rate_error(secs, toks)
    return Steady(
        len(rest),
        len(warm_rows),
        total / len(rest),
        tps,
        spread,
        rel_se,
        k,
        noise_reasons(run, spread),
    )


def noise_reasons(run: LoadedRun, spread: float) -> list[str]:
    """Why a run's timings are noisy: its block spread, the machine's load, the doctor's flag."""
    out = []
    if spread > NOISY_SPREAD:
        out.append(f"block spread {spread:.0%}")
    machine = run.summary.machine or {}
    loaded = loaded_by_average(machine)  # only where others' CPU time was not measured
    if loaded:
        out.append(loaded)
    shared = shared_by_others(machine)
    if shared:
        out.append(shared)
    if any(f.get("id") == "noisy-machine" for f in run.findings):
        out.append("noisy-machine finding")
    return out


def band(a: Steady | None, b: Steady | None) -> tuple[float, float] | None:
    """The noise band (low, high) of a B/A timing ratio, e.g. (0.95, 1.05); None without
    steady figures. Symmetric in log space, so both bounds are positive."""
    if a is None or b is None:
        return None
    floor = NOISY_FLOOR if (a.noisy or b.noisy) else NOISE_FLOOR
    half = max(math.log1p(floor), Z * math.sqrt(a.rel_se**2 + b.rel_se**2))
    return math.exp(-half), math.exp(half)
