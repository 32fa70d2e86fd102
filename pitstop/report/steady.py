"""Steady per-step figures of a run, and the noise band of a ratio between two runs.

Whole-run means are fooled by one slow warm-up step and by a busy machine; medians of the
steady steps are not. Per run (from metrics.jsonl, one line per optimizer step):

- warm-up: the steps the run marks `"warmup": true` (PitstopCallback, `pitstop profile`),
  else the first `DEFAULT_WARMUP` step(s), are left out; the comparison says how many;
- step seconds: the line's `step_seconds` (else its phases' sum); trained tokens of the
  step: `step_trained_tokens` (else the difference of the cumulative `trained_tokens`);
- steady tokens/s: the median over steady steps of each step's tokens ÷ seconds; steady
  step time: the median step seconds;
- spread: the interquartile range of step seconds ÷ their median.

The noise band of a ratio B/A: each run's median has a relative standard error of about
1.2533 · σ / (median · √n), with σ estimated robustly as IQR / 1.349 (both constants are
the normal distribution's); the band is ±Z·√(seA² + seB²) around 1, never narrower than
NOISE_FLOOR (NOISY_FLOOR when either run is flagged noisy: the spread within a run does
not see a load that slowed all of it). A ratio inside the band is "no measurable
difference". These constants are pitstop's choices, named here so the docs can quote them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pitstop.measure.machine import shared_by_others
from pitstop.report.runs import LoadedRun

# Steps left out when the run does not mark its warm-up: a process's first steps create
# kernels for each new shape, grow the allocator's pools and run torch.compile.
DEFAULT_WARMUP = 2
MIN_STEADY_STEPS = 3  # fewer steady steps than this: no medians, no band
Z = 2.0  # band half-width in standard errors (about 95% for a normal error)
NOISE_FLOOR = 0.02  # ±2%: timer resolution and run-to-run variation on a quiet machine
NOISY_FLOOR = 0.05  # ±5% when a run is flagged noisy (its spread or the machine's load)
NOISY_SPREAD = 0.25  # step-time IQR / median above this flags a run as noisy


@dataclass
class Steady:
    """The steady-state figures of one run."""

    steps: int  # steady steps the medians use
    warmup: int  # steps left out at the start
    step_seconds: float  # median
    tokens_per_second: float | None  # median of per-step trained tokens / seconds
    spread: float  # IQR / median of step seconds
    rel_se: float  # relative standard error of the median step time
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


def _quartiles(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


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


def steady(run: LoadedRun) -> Steady | None:
    """The run's steady figures, or None with fewer than MIN_STEADY_STEPS steady steps."""
    warm_rows, rest = split_warmup(step_table(run), lambda row: row[0])
    warm = len(warm_rows)
    if len(rest) < MIN_STEADY_STEPS:
        return None
    secs = [s for _, s, _ in rest]
    med = statistics.median(secs)
    q1, q3 = _quartiles(secs)
    spread = (q3 - q1) / med if med > 0 else 0.0
    rates = [t / s for _, s, t in rest if t is not None]
    tps = statistics.median(rates) if len(rates) == len(rest) else None
    rel_se = 1.2533 * (q3 - q1) / 1.349 / med / math.sqrt(len(secs)) if med > 0 else 0.0
    return Steady(len(rest), warm, med, tps, spread, rel_se, noise_reasons(run, spread))


def noise_reasons(run: LoadedRun, spread: float) -> list[str]:
    """Why a run's timings are noisy: its step spread, the machine's load, the doctor's flag."""
    out = []
    if spread > NOISY_SPREAD:
        out.append(f"step spread {spread:.0%}")
    machine = run.summary.machine or {}
    load, cores = _num(machine.get("load_average_1m")), _num(machine.get("cpu_cores"))
    if load is not None and cores and load > cores:
        out.append(f"load {load:.1f} on {cores:.0f} cores")
    shared = shared_by_others(machine)
    if shared:
        out.append(shared)
    if any(f.get("id") == "noisy-machine" for f in run.findings):
        out.append("noisy-machine finding")
    return out


def band(a: Steady | None, b: Steady | None) -> float | None:
    """Half-width of the noise band of a B/A timing ratio (0.05 = ±5%); None without medians."""
    if a is None or b is None:
        return None
    floor = NOISY_FLOOR if (a.noisy or b.noisy) else NOISE_FLOOR
    return max(floor, Z * math.sqrt(a.rel_se**2 + b.rel_se**2))
