"""The micro-batch sized to the device: the largest that fits with headroom, if it is fastest.

On a GPU the fixed default (two full rows per micro-batch) leaves most of an 80 GB card
empty and runs small, slow kernels (issue 17 measured 8 rows 1.5x faster than 2 on an
H100 with a 1.1B model). Only how a step is split changes: tokens per optimizer step,
and so the training math, stay what the plan says (pitstop.batching.plan).

The rule, with `measure(rows) -> (peak bytes, seconds per micro-batch)` injected (the
trainer runs a few forward+backward passes of a packed micro-batch; tests pass a model):

1. Candidates are the divisors of a step's rows per rank, so every micro-batch of a
   packed step is the same size (no ragged last micro-batch).
2. Measure two small sizes and extrapolate peak memory linearly in rows (weights and
   gradients are the intercept, activations and logits the slope).
3. The budget is the device memory available to the run minus `headroom` of it, minus
   what the first optimizer step will still allocate (AdamW's moments, `reserved`).
   The largest candidate predicted to fit is measured to confirm it; if it does not
   fit, the next smaller one is.
4. Throughput is compared over the sizes measured that fit, plus a halving ladder
   below the pick (pick/2, pick/4, ... down to the second size): a larger micro-batch is kept only when faster than the smaller by more than
   `min_advantage` (a bigger one that is not faster only costs memory: the dense
   document mask of a packed row grows with rows x length^2, for instance).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from pitstop.batching.collate import collate
from pitstop.batching.payoff import Payoff, payoff
from pitstop.batching.plan import MicroBatchSpec, build_plan
from pitstop.catalog.layouts import Layout

__all__ = [
    "SIZING_PASSES",
    "MicroSizeChoice",
    "SizeTrial",
    "choose_micro_rows",
    "modelled_rows",
    "packed_sample",
    "row_candidates",
    "sizing_payoff",
]

GIB = 1 << 30
HEADROOM = 0.10  # of the device memory: allocator fragmentation, the loss's temporaries
MIN_ADVANTAGE = 0.05  # a larger micro-batch must be this much faster to be worth its memory
SIZING_PASSES = 3  # forward+backward passes per size measured: one warm-up, then two timed


@dataclass(frozen=True)
class SizeTrial:
    rows: int
    peak_bytes: float  # math.inf: it ran out of memory
    seconds: float  # one micro-batch's forward+backward (math.inf when out of memory)
    tokens_per_second: float  # positions per second

    @property
    def out_of_memory(self) -> bool:
        return math.isinf(self.peak_bytes)


@dataclass(frozen=True)
class MicroSizeChoice:
    rows: int
    reason: str  # one line for the banner: sizes tried, memory, tokens/s
    trials: list[SizeTrial] = field(default_factory=list)
    budget_bytes: float = 0.0
    predicted_bytes: dict[int, float] = field(default_factory=dict)

    def measurements(self) -> dict[str, Any]:
        return {
            "trials": [asdict(t) for t in self.trials],
            "budget_bytes": self.budget_bytes,
            "predicted_bytes": {str(k): v for k, v in self.predicted_bytes.items()},
        }


def row_candidates(max_rows: int) -> list[int]:
    """Divisors of `max_rows`, ascending: the micro-batch sizes that split a step evenly."""
    return [d for d in range(1, max_rows + 1) if max_rows % d == 0]


def choose_micro_rows(
    measure: Callable[[int], tuple[float, float]],
    *,
    max_rows: int,
    row_tokens: int,
    capacity_bytes: float,
    reserved_bytes: float = 0.0,
    headroom: float = HEADROOM,
    min_advantage: float = MIN_ADVANTAGE,
    start_rows: int = 2,
) -> MicroSizeChoice:
    """Pick the micro-batch rows (see the module docstring). `measure(rows)` returns (peak
    bytes, seconds per micro-batch), with math.inf for both when it ran out of memory."""
    budget = capacity_bytes * (1 - headroom) - reserved_bytes
    trials = _Trials(measure, row_tokens, budget)
    smallest, predicted = _measure_ladder(trials, row_candidates(max(1, max_rows)), start_rows)
    ok = sorted((t for t in trials.done.values() if trials.fits(t)), key=lambda t: t.rows)
    tried = list(trials.done.values())
    if not ok:
        why = (
            f"even {smallest.rows} row(s) of {row_tokens} tokens did not fit in the budget of "
            f"{_gib(budget)} ({_gib(capacity_bytes)} available, {headroom:.0%} headroom, "
            f"{_gib(reserved_bytes)} for the optimizer state); try --gradient-checkpointing"
        )
        return MicroSizeChoice(smallest.rows, why, tried, budget, predicted)
    best = ok[0]
    for t in ok[1:]:
        if t.tokens_per_second > best.tokens_per_second * (1 + min_advantage):
            best = t
    shown = ", ".join(
        f"{t.rows}: out of memory"
        if t.out_of_memory
        else f"{t.rows}: {_gib(t.peak_bytes)}, {t.tokens_per_second:,.0f} tok/s"
        + ("" if trials.fits(t) else " (over budget)")
        for t in sorted(tried, key=lambda t: t.rows)
    )
    biggest = max(t.rows for t in ok)
    why = "the largest that fits" if best.rows == biggest else "fastest of those that fit"
    return MicroSizeChoice(
        best.rows,
        f"{why} (measured rows: {shown}); budget {_gib(budget)} = {_gib(capacity_bytes)} "
        f"available - {headroom:.0%} headroom - {_gib(reserved_bytes)} optimizer state; "
        "tokens per optimizer step unchanged",
        tried,
        budget,
        predicted,
    )


class _Trials:
    """Each size measured once (`trial`), and whether it fits the budget (`fits`)."""

    def __init__(
        self, measure: Callable[[int], tuple[float, float]], row_tokens: int, budget: float
    ) -> None:
        self.measure, self.row_tokens, self.budget = measure, row_tokens, budget
        self.done: dict[int, SizeTrial] = {}

    def trial(self, rows: int) -> SizeTrial:
        if rows not in self.done:
            peak, sec = self.measure(rows)
            ok = sec > 0 and not math.isinf(sec)
            tps = rows * self.row_tokens / sec if ok else 0.0
            self.done[rows] = SizeTrial(rows, float(peak), float(sec), tps)
        return self.done[rows]

    def fits(self, t: SizeTrial) -> bool:
        return not t.out_of_memory and t.peak_bytes <= self.budget


def _measure_ladder(
    trials: _Trials, cands: list[int], start_rows: int
) -> tuple[SizeTrial, dict[int, float]]:
    """Steps 2-4 of the module docstring: two small sizes, the largest predicted to fit
    (confirmed, else the next smaller), and a halving ladder below it. Returns (the
    smallest size tried at the start, the peak predicted for each candidate)."""
    small = [c for c in cands if c <= start_rows]
    a = small[-1] if small else cands[0]
    larger = [c for c in cands if c > a]
    b = larger[0] if larger else None
    ta = trials.trial(a)
    while not trials.fits(ta) and a > cands[0]:  # even the start does not fit: go down
        a = max(c for c in cands if c < a)
        b = None
        ta = trials.trial(a)
    predicted: dict[int, float] = {}
    if not trials.fits(ta) or b is None:
        return ta, predicted
    tb = trials.trial(b)
    if not trials.fits(tb):
        return ta, predicted
    slope = max((tb.peak_bytes - ta.peak_bytes) / (b - a), 1.0)
    base = ta.peak_bytes - slope * a
    predicted = {c: base + slope * c for c in cands}
    pick = max(c for c in cands if c <= b or predicted[c] <= trials.budget)
    while pick > b and not trials.fits(trials.trial(pick)):  # confirm; else step down
        pick = max(c for c in cands if c < pick)
    # Is the pick also the fastest? Time a halving ladder below it, down to b.
    cur = pick
    while (below := [c for c in cands if c <= cur // 2]) and below[-1] > b:
        cur = below[-1]
        trials.trial(cur)
    return ta, predicted


def sizing_payoff(
    *,
    max_rows: int,
    row_tokens: int,
    run_positions: float,
    seconds_per_position: float | None,
    predicted_rows: int | None = None,
) -> Payoff | None:
    """Whether measuring the micro-batch can pay back on this run (None: no estimate).

    Its cost: SIZING_PASSES passes at each size the rule measures, about 2 + 4 + the pick
    + its halving ladder (the pick: the cost model's largest fit, else `max_rows`); what it
    can gain over the cost model's pick: MIN_ADVANTAGE of the run (`run_positions`, this
    process's share)."""
    if not seconds_per_position:
        return None
    pick = max(1, min(max_rows, predicted_rows or max_rows))
    rows = 2 + 4 + 2 * pick  # the two small sizes, the pick and its ladder (pick/2 + ...)
    cost = SIZING_PASSES * rows * row_tokens * seconds_per_position
    return payoff(cost, run_positions * seconds_per_position, MIN_ADVANTAGE)


def modelled_rows(
    predict: Callable[[int], float] | None,
    *,
    max_rows: int,
    capacity_bytes: float,
    headroom: float = HEADROOM,
) -> tuple[int | None, str]:
    """(rows, why) from the memory cost model, unmeasured: the largest divisor of a step's
    rows whose predicted peak (`predict(rows)`: weights, gradients, optimizer state,
    activations; pitstop.measure.cost_model) fits the device less the headroom; None (the
    default split) without a prediction or when even one row does not fit."""
    budget = capacity_bytes * (1 - headroom)
    if predict is None:
        return None, "no memory estimate for this model: the default split"
    fit = [c for c in row_candidates(max(1, max_rows)) if predict(c) <= budget]
    if not fit:
        return None, f"the cost model fits not even 1 row in {_gib(budget)}: the default split"
    rows = fit[-1]
    return rows, (
        f"the largest that fits by the memory cost model ({rows} rows: ~{_gib(predict(rows))} "
        f"predicted of a budget of {_gib(budget)} = {_gib(capacity_bytes)} available - "
        f"{headroom:.0%} headroom); tokens per optimizer step unchanged"
    )


def largest_predicted(
    predict: Callable[[int], float] | None, max_rows: int, capacity_bytes: float
) -> int | None:
    """The cost model's largest fitting micro-batch, for estimating what sizing would run."""
    return modelled_rows(predict, max_rows=max_rows, capacity_bytes=capacity_bytes)[0]


def _gib(n: float) -> str:
    return "inf" if math.isinf(n) else f"{n / GIB:.1f} GiB"


def packed_sample(
    store: Any,
    *,
    rows: int,
    max_seq_len: int,
    tokens_per_step: int,
    seed: int,
    trained: np.ndarray,
    indices: np.ndarray | None = None,
) -> dict[str, Any]:
    """A micro-batch of `rows` packed rows of real data (the first rows of epoch 0's pack
    plan, repeated when the data holds fewer): the largest micro-batch of that many rows
    any layout produces, so its memory bounds the run's."""
    plan = build_plan(
        np.asarray(store.lengths, dtype=np.int64),
        strategy=Layout.PACK,  # the widest rows of any layout (see above)
        max_seq_len=max_seq_len,
        tokens_per_step=tokens_per_step,
        seed=seed,
        epoch=0,
        indices=indices,
        trained=trained,
    )
    b = plan.row_bounds
    picked = tuple(plan.seqs[b[r % plan.n_rows] : b[r % plan.n_rows + 1]] for r in range(rows))
    spec = MicroBatchSpec(picked, max_seq_len)
    return collate(store.tokens, store.mask, store.offsets, spec, store.pad_id)
