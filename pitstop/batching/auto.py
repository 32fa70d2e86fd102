"""`batching: auto`: pick pack, bucket or pad by a cost model where it is clear, else by
timing them on this device and model.

Where the answer follows from the layouts' shapes, no time is spent measuring (issue 23:
a first run must not pay a start-up tax):

- pad never wins where bucket exists: bucket holds the same one-document rows, padded
  only to each micro-batch's longest instead of max_seq_len, so it never computes more
  positions, with the same kernels. pad is not timed.
- with a per-document attention kernel (`PER_DOCUMENT_ATTENTION`: flash-attn's varlen
  path, pitstop's sdpa_docs on a CPU), a packed row's attention costs the sum of its documents'
  squared lengths, the same as each document in a row of its own; only padding (which
  a one-document row's attention includes) differs, and everything else costs per
  position. So the layout computing the fewest positions is the cheapest, and is chosen
  without timing; the banner says so with the positions. (With full rows that is pack,
  unless micro-batches of one row leave bucket no padding at all.)

Otherwise (a kernel that gives packed rows a dense mask, e.g. --attention sdpa), the
layouts are timed as below.

Which layout trains fastest depends on things no rule of thumb captures: packing
wastes no positions but makes transformers build a block-diagonal mask (on CPU SDPA
and eager attention that mask costs the full row length squared, and blocks the
fast causal kernel); bucketing keeps the causal fast path but pads each micro-batch
to its longest row; padding everything to max length is only competitive when the
data is already that long. So we measure.

Every layout is an arrangement of the same step plan (pitstop.batching.plan): the
same documents in every step, so the same training math, and the fastest layout is
the one with the smallest estimated epoch compute time. For each layout we sort this
rank's micro-batches of up to SAMPLED_STEPS steps spread over epoch 0 by size, split them
into `samples` equal-count strata, and time the median micro-batch of each stratum (after
`warmup` untimed runs of the largest one); the estimate is scaled to the epoch's positions,
counted in numpy (plan.plan_efficiency), so nothing per micro-batch of the whole epoch is
built however large the data. Timing is fragile on a busy machine, so:

- layouts take turns within each round (interleaved), so load that comes and goes
  hits them alike; each sample keeps its fastest timing over the rounds;
- rounds repeat (at least `min_rounds`, at most `max_rounds`) until the ranking is
  the same two rounds in a row or no layout is ahead by more than the noise;
- the noise is the spread of each layout's per-round estimates (median absolute
  deviation over the median, the worst layout's), and it is reported;
- a layout that computes more positions than the leanest one must be faster by more
  than the noise (and at least `MIN_ADVANTAGE`); otherwise the leanest layout wins.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from pitstop.batching.collate import collate
from pitstop.batching.payoff import Payoff, payoff
from pitstop.batching.plan import (
    Efficiency,
    Plan,
    build_plan,
    keep_plan,
    plan_efficiency,
    step_micro_batches,
)
from pitstop.batching.rank_plan import build_rank_plans
from pitstop.batching.records import MicroBatch
from pitstop.batching.settings import BatchSettings
from pitstop.catalog.layouts import Layout
from pitstop.core.config import RunConfig
from pitstop.core.errors import ConfigError
from pitstop.data.facts import sequence_facts
from pitstop.data.store import TokenStore

__all__ = ["AutoChoice", "StrategyTiming", "choose_batching"]

_T = TypeVar("_T")


# Kernels that compute each packed document's attention alone (the cost model above).
PER_DOCUMENT_ATTENTION = frozenset({"flash_attention_2", "sdpa_docs"})


def cost_model_applies(kernel: str | None, device_type: str) -> bool:
    """Whether `batching: auto` may pick the layout from positions alone for `kernel` on
    `device_type` (else it times them). Not for sdpa_docs on a GPU: there it pays a kernel
    launch per document (or per length; a dense mask past its launch cap,
    train/doc_attention.py MAX_CALLS), which positions do not count."""
    if kernel == "sdpa_docs" and device_type == "cuda":
        return False
    return kernel in PER_DOCUMENT_ATTENTION


# A handful of rounds can underestimate the noise; a margin this small flipped the
# choice between runs of the same command on a busy 2-core machine (issue 16).
MIN_ADVANTAGE = 0.05


@dataclass(frozen=True)
class StrategyTiming:
    strategy: Layout
    tokens_per_second: float  # trained (target) tokens per second of forward+backward, estimated
    epoch_seconds: float  # estimated forward+backward seconds for this rank's epoch
    packing_efficiency: float  # real tokens / positions computed, epoch 0, every rank
    timed_micro_batches: int
    timed_seconds: float
    positions: int = 0  # positions computed in epoch 0, every rank
    noise: float = 0.0  # relative spread of the per-round epoch estimates


@dataclass(frozen=True)
class AutoChoice:
    strategy: Layout
    reason: str  # one line for the run banner, with the measured numbers
    timings: dict[str, StrategyTiming] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # strategy -> why it was not timed
    noise: float = 0.0  # the measurement's relative noise (worst layout's)
    rounds: int = 0
    # Set when timing was skipped because it would not pay back on this run (not cached:
    # a longer run of the same configuration times).
    unpaid: Payoff | None = None


def choose_batching(
    store: TokenStore,
    cfg: RunConfig,
    run_micro_batch: Callable[[MicroBatch], object],
    *,
    rank: int = 0,
    world_size: int = 1,
    candidates: tuple[Layout, ...] = tuple(Layout),
    samples: int = 4,
    warmup: int = 1,
    min_rounds: int = 3,
    max_rounds: int = 8,
    clock: Callable[[], float] = time.perf_counter,
    indices: np.ndarray | None = None,
    lockstep: bool = False,
    broadcast: bool = True,
    progress: Callable[[str], None] | None = None,
    seconds_per_position: float | None = None,
) -> AutoChoice:
    """Time each candidate layout with `run_micro_batch` and return the decision rule's pick.

    `run_micro_batch(batch)` must run one forward+backward of a micro-batch dict (as
    the loader yields it, still on CPU) and return only when the work is done (on
    CUDA: synchronize, e.g. `loss.item()`); it should not step the optimizer.
    Gradients it accumulates are the caller's to zero. `clock` is injectable for tests;
    `progress(line)` hears about each round.

    With several ranks, each rank times its own shard and timings differ: every rank
    must use the same layout, so when a torch.distributed process group is up (and
    `broadcast`), every rank returns rank 0's choice. All ranks time at once, so each
    measures under the same load as training. `indices` and `lockstep` are the
    loader's (held-out split, FSDP micro-batch padding).

    `run_micro_batch.attention` and `.device_type` (optional attributes, default CPU):
    the attention kernel it runs and where; where `cost_model_applies` the cost model
    decides without timing. `seconds_per_position` (an estimate of a position's
    forward+backward here): the timing is spent only when the planned run could gain
    more than it costs (`timing_payoff`), else the cost model decides and says why.
    """
    laid = _lay_out(
        store,
        cfg,
        candidates,
        rank=rank,
        world_size=world_size,
        samples=samples,
        indices=indices,
        lockstep=lockstep,
    )
    kernel = getattr(run_micro_batch, "attention", None)
    if cost_model_applies(kernel, getattr(run_micro_batch, "device_type", "cpu")):
        choice = _cost_model_choice(laid.effs, laid.prepared, laid.skipped, kernel)
    else:
        pays = timing_payoff(
            laid,
            cfg,
            world_size=world_size,
            rounds=min_rounds,
            warmup=warmup,
            seconds_per_position=seconds_per_position,
        )
        if pays is not None and not pays.worth:
            choice = _unpaid_choice(laid, kernel, pays)
        else:
            timed = _time_rounds(
                store,
                run_micro_batch,
                laid,
                world_size=world_size,
                warmup=warmup,
                min_rounds=min_rounds,
                max_rounds=max_rounds,
                clock=clock,
                progress=progress,
            )
            choice = _timed_choice(laid, timed, warmup)
    return _kept(rank0_choice(choice, world_size) if broadcast else choice, laid.leanest_plan)


@dataclass
class _LaidOut:
    """Each candidate layout of epoch 0, laid out and sampled for timing."""

    # layout -> (sampled micro-batch specs sorted by size, strata of their indices)
    prepared: dict[str, tuple[list[Any], list[np.ndarray]]]
    effs: dict[str, Efficiency]
    skipped: dict[str, str]  # layout -> why it is not timed
    leanest_plan: Plan | None  # kept for the loader when it wins (plan.keep_plan)
    targets: np.ndarray  # each sequence's trained tokens
    n_steps: int  # epoch 0's optimizer steps (the leanest plan's)

    @property
    def positions(self) -> dict[str, int]:
        """The epoch's positions computed by each layout still timed, every rank's."""
        return {k: self.effs[k].positions for k in self.prepared}


def _lay_out(
    store: TokenStore,
    cfg: RunConfig,
    candidates: tuple[Layout, ...],
    *,
    rank: int,
    world_size: int,
    samples: int,
    indices: np.ndarray | None,
    lockstep: bool,
) -> _LaidOut:
    """Every valid candidate's plan of epoch 0, its efficiency, and the micro-batches to time
    (in strata by size); a layout another is never slower than is dropped untimed."""
    # The store's facts as they are (int32, memory-mapped), not int64 copies (164 MB at 10M)
    facts = sequence_facts(store)
    lengths, targets = facts.lengths, facts.trained
    skipped: dict[str, str] = {}
    valid: dict[str, BatchSettings] = {}
    for strategy in candidates:
        try:
            valid[strategy] = BatchSettings.from_config(
                cfg, world_size=world_size, strategy=strategy
            )
        except ConfigError as e:
            skipped[strategy] = "; ".join(e.problems)
    # Under several ranks each holds only its share of each layout (rank_plan), all built in
    # one pass of the step plan; a layout counted from another's rows (below) is not built.
    shares: dict[Layout, Plan] = {}
    laid_out = {k: v for k, v in valid.items() if Layout.parse(k).dominated_by not in valid}
    if world_size > 1 and laid_out:
        shares = build_rank_plans(
            lengths,
            settings=laid_out,
            seed=cfg.seed,
            epoch=0,
            rank=rank,
            indices=indices,
            trained=targets,
            lockstep=lockstep,
        )
    laid = _LaidOut({}, {}, skipped, None, targets, 0)
    dominating: dict[str, Plan] = {}  # plans of layouts that hold another's rows padded less
    for strategy, settings in valid.items():
        better = Layout.parse(strategy).dominated_by
        if better in dominating:
            # Never timed (below), and its rows are `better`'s, each padded to max_seq_len:
            # counted from that plan, not laid out again (~1 s at 10M documents).
            same_rows = dataclasses.replace(dominating[better], strategy=strategy)
            laid.effs[strategy] = plan_efficiency(same_rows, settings, lockstep=lockstep)
            laid.prepared[strategy] = ([], [])
            continue
        # Every layout arranges the same step plan (built once: plan.py shares it).
        plan = shares.get(Layout.parse(strategy)) or build_plan(
            lengths,
            strategy=strategy,
            max_seq_len=settings.max_seq_len,
            tokens_per_step=settings.tokens_per_step,
            seed=cfg.seed,
            epoch=0,
            indices=indices,
            trained=targets,
        )
        _sample(laid, strategy, plan, settings, rank, samples, lockstep, lengths)
        if any(Layout.parse(c).dominated_by == strategy for c in candidates):
            dominating[strategy] = plan
    dominating.clear()  # done with (the loader's plan, if any, is kept by keep_plan)
    shares.clear()
    if not laid.prepared:
        raise ConfigError(
            [f"{k}: {v}" for k, v in skipped.items()],
            header="batching=auto found no strategy it could run:",
        )
    _drop_dominated(laid)
    return laid


def _sample(
    laid: _LaidOut,
    strategy: str,
    plan: Plan,
    settings: BatchSettings,
    rank: int,
    samples: int,
    lockstep: bool,
    lengths: np.ndarray,
) -> None:
    """`strategy`'s efficiency and micro-batches to time, added to `laid`."""
    # The epoch's positions counted in numpy; the micro-batches to time come from a
    # sample of its steps (a Python object per micro-batch of the whole epoch cost
    # seconds and ~100 MB per million documents, for strata of a few samples).
    specs = [
        spec
        for step in sampled_steps(plan.n_steps)
        for spec in step_micro_batches(plan, step, settings, rank, lockstep=lockstep)
    ]
    if not specs:
        laid.skipped[strategy] = "no micro-batches (empty store)"
        return
    laid.effs[strategy] = plan_efficiency(plan, settings, lockstep=lockstep, lengths=lengths)
    lean = laid.leanest_plan
    if lean is None or laid.effs[strategy].positions < laid.effs[lean.strategy].positions:
        laid.leanest_plan = plan
        laid.n_steps = plan.n_steps
    specs.sort(key=lambda s: s.n_positions)
    strata = np.array_split(np.arange(len(specs)), min(samples, len(specs)))
    laid.prepared[strategy] = (specs, strata)


def _drop_dominated(laid: _LaidOut) -> None:
    """A layout another candidate is never slower than (catalog.layouts) is not timed."""
    positions = laid.positions
    for layout in list(laid.prepared):
        better = Layout.parse(layout).dominated_by
        if better is not None and better in laid.prepared:
            laid.skipped[layout] = (
                f"not timed: {better} holds the same rows padded less ({positions[better]:,} "
                f"positions against {positions[layout]:,}) with the same kernels, so {layout} "
                "cannot win"
            )
            del laid.prepared[layout]


@dataclass
class _Timed:
    """What the interleaved rounds measured."""

    times: dict[str, list[list[float]]]  # layout -> [round][stratum] seconds
    weights: dict[str, np.ndarray]
    scale: dict[str, float]
    rounds: int
    ranking: list[str]


def _time_rounds(
    store: TokenStore,
    run_micro_batch: Callable[[MicroBatch], object],
    laid: _LaidOut,
    *,
    world_size: int,
    warmup: int,
    min_rounds: int,
    max_rounds: int,
    clock: Callable[[], float],
    progress: Callable[[str], None] | None,
) -> _Timed:
    """Interleaved rounds of each layout's sampled micro-batches until the ranking settles."""
    prepared, positions = laid.prepared, laid.positions

    def run(spec: Any) -> float:
        batch = collate(store.tokens, store.mask, store.offsets, spec, store.pad_id)
        t0 = clock()
        run_micro_batch(batch)
        return clock() - t0

    for specs, _ in prepared.values():
        for _ in range(warmup):
            run(specs[-1])  # the largest shape: allocator, kernels and autotuning warm up
    names = list(prepared)
    # Seconds of the sampled micro-batches, scaled to this rank's share of the epoch.
    scale = {k: _epoch_scale(prepared[k][0], positions[k], world_size) for k in names}
    weights = {k: _stratum_weights(*prepared[k]) * scale[k] for k in names}
    times: dict[str, list[list[float]]] = {k: [] for k in names}  # [round][stratum]
    ranking: list[str] = []
    rounds = 0
    for rounds in range(1, max(1, max_rounds) + 1):
        if progress is not None:
            bounds = f"at least {min_rounds}, at most {max_rounds}"
            progress(f"measuring batching layouts: round {rounds} ({bounds}) of {', '.join(names)}")
        shift = (rounds - 1) % len(names)  # a different layout goes first each round
        for strategy in names[shift:] + names[:shift]:
            specs, strata = prepared[strategy]
            times[strategy].append([run(specs[int(idx[len(idx) // 2])]) for idx in strata])
        est = {k: _estimate(times[k], weights[k]) for k in names}
        noise = max(_noise(times[k], weights[k]) for k in names)
        winner = _decide(est, positions, noise)
        previous, ranking = ranking, sorted(names, key=lambda k: est[k])
        if rounds >= min_rounds and (ranking == previous or winner == _leanest(positions)):
            break
    return _Timed(times, weights, scale, rounds, ranking)


def _timed_choice(laid: _LaidOut, timed: _Timed, warmup: int) -> AutoChoice:
    """The decision rule's pick from the timings, with the banner's reason."""
    positions, times, weights = laid.positions, timed.times, timed.weights
    names = list(laid.prepared)
    est = {k: _estimate(times[k], weights[k]) for k in names}
    noise = max(_noise(times[k], weights[k]) for k in names)
    best = _decide(est, positions, noise)
    timings: dict[str, StrategyTiming] = {}
    for strategy, (specs, _) in laid.prepared.items():
        sampled_targets = sum(
            int(laid.targets[np.concatenate(s.rows)].sum(dtype=np.int64)) for s in specs if s.rows
        )
        e = est[strategy]
        sampled_seconds = e / timed.scale[strategy]  # the sample's rate is the epoch's estimate
        timings[strategy] = StrategyTiming(
            strategy=strategy,
            tokens_per_second=sampled_targets / sampled_seconds if e > 0 else float("inf"),
            epoch_seconds=e,
            packing_efficiency=laid.effs[strategy].packing_efficiency,
            timed_micro_batches=len(times[strategy][0]),
            timed_seconds=float(sum(map(sum, times[strategy]))),
            positions=positions[strategy],
            noise=_noise(times[strategy], weights[strategy]),
        )
    parts = [
        f"{t.strategy} {t.tokens_per_second:,.0f} trained tok/s ({t.packing_efficiency:.1%} of positions real)"
        for t in sorted(timings.values(), key=lambda t: t.epoch_seconds)
    ]
    leanest = _leanest(positions)
    if best != leanest:
        why = "fastest by more than the noise"
    elif timed.ranking[0] != best:
        why = f"fewest positions; {timed.ranking[0]} was not ahead by more than the noise"
    else:
        why = "fewest positions"
    n = max(t.timed_micro_batches for t in timings.values())
    reason = (
        f"{why}; measured on this device ({n} micro-batches each, {timed.rounds} interleaved "
        f"rounds, noise ±{noise:.1%}, after {warmup} warm-up): "
        + ", ".join(parts)
        + "".join(f"; {k} skipped: {v}" for k, v in laid.skipped.items())
    )
    return AutoChoice(best, reason, timings, laid.skipped, noise, timed.rounds)  # type: ignore[arg-type]


def _kept(choice: AutoChoice, leanest: Plan | None) -> AutoChoice:
    """`choice`, keeping its layout's plan for the loader when it is the one at hand (the
    leanest usually wins; another is laid out again by the loader)."""
    if leanest is not None and leanest.strategy == choice.strategy:
        keep_plan(leanest)
    return choice


def _cost_model_choice(
    effs: dict[str, Efficiency],
    prepared: dict[str, tuple[list[Any], list[np.ndarray]]],
    skipped: dict[str, str],
    kernel: str | None,
    unpaid: Payoff | None = None,
) -> AutoChoice:
    """The layout with the fewest positions, decided without timing: with per-document
    attention, or where timing would not pay back on this run (`unpaid`)."""
    positions = {k: effs[k].positions for k in prepared}
    table = ", ".join(
        f"{k} {positions[k]:,} positions ({effs[k].packing_efficiency:.1%} real)"
        for k in sorted(prepared, key=lambda k: positions[k])
    )
    best = _leanest(positions)
    if unpaid is not None:
        why = (
            f"cost model, not timed: timing the layouts would not pay on this run "
            f"({unpaid.describe('timing')}), so the fewest positions computed: {table}"
        )
    else:
        why = (
            f"cost model, not timed: with per-document attention ({kernel}) a packed row's "
            "attention costs the sum of its documents' squared lengths, as rows of one "
            f"document do, so the fewest positions computed is the cheapest: {table}"
        )
    reason = why + "".join(f"; {k} {v}" for k, v in skipped.items())
    choice = AutoChoice(best, reason, {}, skipped, 0.0, 0)  # type: ignore[arg-type]
    return dataclasses.replace(choice, unpaid=unpaid)


# Where timing is skipped for a kernel the positions do not price (sdpa_docs on a GPU): one
# document per row runs each micro-batch's attention as one fused causal call; packed rows
# pay a launch per document, or a dense mask past the launch cap. Measured on an H200
# (2026-11-27, bench/gpu_lent.sh, a 1.1B Llama): pack at 32 rows trained 18.4k tokens/s where
# the timed choice, bucket at 16 rows, had trained 47.1k (2026-11-26, headline-gpu.md).
ONE_CALL_LAYOUTS_ON_GPU = "sdpa_docs"


def _unpaid_choice(laid: _LaidOut, kernel: str | None, pays: Payoff) -> AutoChoice:
    """The layout when timing would not pay: the fewest positions, among the layouts of
    one document per row where the kernel's cost is not in the positions (sdpa_docs on a
    GPU: `cost_model_applies` is False for it for that reason)."""
    if kernel != ONE_CALL_LAYOUTS_ON_GPU:
        return _cost_model_choice(laid.effs, laid.prepared, laid.skipped, kernel, pays)
    one_doc = {
        k: v for k, v in laid.prepared.items() if not (Layout.lookup(k) or Layout.PACK).packed
    }
    if not one_doc:
        return _cost_model_choice(laid.effs, laid.prepared, laid.skipped, kernel, pays)
    choice = _cost_model_choice(laid.effs, one_doc, laid.skipped, kernel, pays)
    packed = sorted(set(laid.prepared) - set(one_doc))
    why = (
        f"; {', '.join(packed)} left out: {kernel} on a GPU runs a packed row's attention as a "
        "launch per document (a dense mask past its launch cap), which positions do not count; "
        "one document per row is one fused call (an H200 trained 2.6x faster with bucket than "
        "with pack untimed)"
    )
    return dataclasses.replace(choice, reason=choice.reason + why)


def timing_payoff(
    laid: _LaidOut,
    cfg: RunConfig,
    *,
    world_size: int,
    rounds: int,
    warmup: int,
    seconds_per_position: float | None,
) -> Payoff | None:
    """Whether timing the layouts can pay back on this run (None: no estimate to tell).

    Its cost: `warmup` + `rounds` timed passes of every stratum's micro-batch of each layout
    timed, at the estimated seconds per position; what it can gain: a layout faster by
    more than MIN_ADVANTAGE (the smallest lead the rule acts on) over the run's planned
    positions, this rank's share."""
    if not seconds_per_position or len(laid.prepared) < 2:
        return None
    passes = sum(
        (warmup * specs[-1].n_positions if specs else 0)
        + rounds * sum(specs[int(idx[len(idx) // 2])].n_positions for idx in strata)
        for specs, strata in laid.prepared.values()
    )
    lean = min(laid.positions.values())
    if cfg.max_steps:
        run_positions = lean * cfg.max_steps / max(1, laid.n_steps)  # max_steps wins
    else:
        run_positions = lean * float(cfg.epochs or 1.0)
    run_seconds = run_positions / max(1, world_size) * seconds_per_position
    return payoff(passes * seconds_per_position, run_seconds, MIN_ADVANTAGE)


# Steps whose micro-batches `choose_batching` samples: evenly spread over the epoch.
SAMPLED_STEPS = 256


def sampled_steps(n_steps: int, k: int | None = None) -> list[int]:
    """Up to `k` (SAMPLED_STEPS) step indices spread evenly over `n_steps` (all when fewer)."""
    k = SAMPLED_STEPS if k is None else k
    if n_steps <= k:
        return list(range(n_steps))
    return sorted({int(x) for x in np.linspace(0, n_steps - 1, k).round()})


def _epoch_scale(specs: list[Any], epoch_positions: int, world_size: int) -> float:
    """This rank's share of the epoch's positions over the sampled micro-batches' positions."""
    sampled = sum(s.n_positions for s in specs)
    return epoch_positions / max(1, world_size) / max(1, sampled)


def _stratum_weights(specs: list[Any], strata: list[np.ndarray]) -> np.ndarray:
    """Per stratum: its positions / its timed sample's positions (time scales with positions)."""
    out = []
    for idx in strata:
        sample = specs[int(idx[len(idx) // 2])]
        out.append(sum(specs[int(i)].n_positions for i in idx) / max(1, sample.n_positions))
    return np.asarray(out, dtype=np.float64)


def _estimate(times: list[list[float]], weights: np.ndarray) -> float:
    """Epoch seconds: each sample's fastest timing over the rounds (a burst of load is
    filtered out), scaled to its stratum's positions."""
    return float(np.min(np.asarray(times), axis=0) @ weights)


def _noise(times: list[list[float]], weights: np.ndarray) -> float:
    """Relative spread of the per-round epoch estimates: median absolute deviation / median."""
    per_round = np.asarray(times) @ weights
    if len(per_round) < 2:
        return float("inf")  # one round says nothing about the noise
    med = float(np.median(per_round))
    return float(np.median(np.abs(per_round - med)) / med) if med > 0 else 0.0


def _leanest(positions: dict[str, int]) -> str:
    return min(positions, key=lambda k: (positions[k], k))


def _decide(est: dict[str, float], positions: dict[str, int], noise: float) -> str:
    """The leanest layout, unless another is faster by more than the noise (and MIN_ADVANTAGE)."""
    base = _leanest(positions)
    margin = max(noise, MIN_ADVANTAGE)
    ahead = [k for k in est if est[k] < est[base] * (1 - margin)]
    return min(ahead, key=lambda k: est[k]) if ahead else base


def rank0_choice(choice: _T, world_size: int) -> _T:
    """Every rank adopts rank 0's measured choice (ranks' own timings differ by noise)."""
    import torch.distributed as dist

    if world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
        return choice
    box = [choice]
    dist.broadcast_object_list(box, src=0)
    return box[0]
