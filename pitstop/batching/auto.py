"""`batching: auto`: pick pack, bucket or pad by timing them on this device and model.

Which strategy trains fastest depends on things no rule of thumb captures: packing
wastes no positions but makes transformers build a block-diagonal mask (on CPU SDPA
and eager attention that mask costs the full row length squared, and blocks the
fast causal kernel); bucketing keeps the causal fast path but pads each micro-batch
to its longest row; padding everything to max length is only competitive when the
data is already that long. So we measure.

Every strategy trains the same target tokens per epoch (each sequence exactly once),
so the fastest strategy is the one with the smallest estimated epoch compute time.
For each strategy we sort this rank's micro-batches of epoch 0 by size, split them
into `samples` equal-count strata, time the median micro-batch of each stratum (after
`warmup` untimed runs of the largest one), and estimate the epoch as
Σ stratum size × its measured time. Trained tokens/s = epoch targets / that estimate.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pitstop.batching.collate import collate
from pitstop.batching.loader import _pad_id, _seen_tokens, sequence_targets
from pitstop.batching.plan import build_plan, step_micro_batches
from pitstop.batching.settings import STRATEGIES, BatchSettings, Strategy
from pitstop.config import RunConfig
from pitstop.data.store import TokenStore
from pitstop.errors import ConfigError

__all__ = ["AutoChoice", "StrategyTiming", "choose_batching"]


@dataclass(frozen=True)
class StrategyTiming:
    strategy: Strategy
    tokens_per_second: float  # trained (target) tokens per second of forward+backward, estimated
    epoch_seconds: float  # estimated forward+backward seconds for this rank's epoch
    packing_efficiency: float  # real tokens / positions computed, this rank, epoch 0
    timed_micro_batches: int
    timed_seconds: float


@dataclass(frozen=True)
class AutoChoice:
    strategy: Strategy
    reason: str  # one line for the run banner, with the measured numbers
    timings: dict[str, StrategyTiming] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # strategy -> why it was not timed


def choose_batching(
    store: TokenStore,
    cfg: RunConfig,
    run_micro_batch: Callable[[dict[str, Any]], object],
    *,
    rank: int = 0,
    world_size: int = 1,
    candidates: tuple[Strategy, ...] = STRATEGIES,
    samples: int = 4,
    warmup: int = 1,
    repeats: int = 2,
    clock: Callable[[], float] = time.perf_counter,
    indices: np.ndarray | None = None,
    lockstep: bool = False,
    broadcast: bool = True,
) -> AutoChoice:
    """Time each candidate strategy with `run_micro_batch` and return the fastest.

    `run_micro_batch(batch)` must run one forward+backward of a micro-batch dict (as
    the loader yields it, still on CPU) and return only when the work is done (on
    CUDA: synchronize, e.g. `loss.item()`); it should not step the optimizer.
    Gradients it accumulates are the caller's to zero. `clock` is injectable for tests.

    With several ranks, each rank times its own shard and timings differ: every rank
    must use the same strategy (it defines the steps), so when a torch.distributed
    process group is up (and `broadcast`), every rank returns rank 0's choice. All
    ranks time at once, so each measures under the same load as training. `indices`
    and `lockstep` are the loader's (held-out split, FSDP micro-batch padding).
    """
    lengths = np.asarray(store.lengths, dtype=np.int64)
    targets = sequence_targets(store)
    pad_id = _pad_id(store)
    timings: dict[str, StrategyTiming] = {}
    skipped: dict[str, str] = {}
    prepared: dict[str, tuple[list[Any], list[np.ndarray]]] = {}
    for strategy in candidates:
        try:
            settings = BatchSettings.from_config(cfg, world_size=world_size, strategy=strategy)
        except ConfigError as e:
            skipped[strategy] = "; ".join(e.problems)
            continue
        plan = build_plan(
            lengths,
            strategy=strategy,
            max_seq_len=settings.max_seq_len,
            tokens_per_step=settings.tokens_per_step,
            seed=cfg.seed,
            epoch=0,
            indices=indices,
            trained=targets,
        )
        specs = [
            spec
            for step in range(plan.n_steps)
            for spec in step_micro_batches(plan, step, settings, rank, lockstep=lockstep)
        ]
        if not specs:
            skipped[strategy] = "no micro-batches (empty store)"
            continue
        specs.sort(key=lambda s: s.n_positions)
        strata = np.array_split(np.arange(len(specs)), min(samples, len(specs)))
        prepared[strategy] = (specs, strata)

    def run(spec: Any) -> float:
        batch = collate(store.tokens, store.mask, store.offsets, spec, pad_id)
        t0 = clock()
        run_micro_batch(batch)
        return clock() - t0

    for specs, _ in prepared.values():
        for _ in range(warmup):
            run(specs[-1])  # the largest shape: allocator, kernels and autotuning warm up
    # Strategies take turns, and each sample keeps its fastest of `repeats` timings: a
    # burst of background load then hits every strategy alike and is filtered out, instead
    # of deciding the choice (seen on a busy 2-core machine with one timing per sample).
    best_t: dict[str, list[float]] = {k: [float("inf")] * len(v[1]) for k, v in prepared.items()}
    for _ in range(max(1, repeats)):
        for strategy, (specs, strata) in prepared.items():
            for j, idx in enumerate(strata):
                t = run(specs[int(idx[len(idx) // 2])])
                best_t[strategy][j] = min(best_t[strategy][j], t)
    for strategy, (specs, strata) in prepared.items():
        # Each sample's time per computed position, times the positions of its stratum: exact
        # when cost is linear in positions, and strata of similar shapes carry the rest.
        est = 0.0
        for t, idx in zip(best_t[strategy], strata):
            sample = specs[int(idx[len(idx) // 2])]
            est += t / max(1, sample.n_positions) * sum(specs[int(i)].n_positions for i in idx)
        timed = sum(best_t[strategy])
        seen = sum(_seen_tokens(store.offsets, s) for s in specs)
        positions = sum(s.n_positions for s in specs)
        rank_targets = int(sum(int(targets[np.concatenate(s.rows)].sum()) for s in specs if s.rows))
        timings[strategy] = StrategyTiming(
            strategy=strategy,
            tokens_per_second=rank_targets / est if est > 0 else float("inf"),
            epoch_seconds=est,
            packing_efficiency=seen / positions,
            timed_micro_batches=len(strata),
            timed_seconds=timed,
        )
    if not timings:
        raise ConfigError(
            [f"{k}: {v}" for k, v in skipped.items()],
            header="batching=auto found no strategy it could run:",
        )
    best = min(timings.values(), key=lambda t: t.epoch_seconds)
    parts = [
        f"{t.strategy} {t.tokens_per_second:,.0f} trained tok/s ({t.packing_efficiency:.1%} of positions real)"
        for t in sorted(timings.values(), key=lambda t: t.epoch_seconds)
    ]
    n = max(t.timed_micro_batches for t in timings.values())
    reason = (
        f"measured on this device ({n} micro-batches each, best of {max(1, repeats)}, "
        f"after {warmup} warm-up): "
        + ", ".join(parts)
        + "".join(f"; {k} skipped: {v}" for k, v in skipped.items())
    )
    choice = AutoChoice(best.strategy, reason, timings, skipped)
    return _rank0_choice(choice, world_size) if broadcast else choice


def _rank0_choice(choice: AutoChoice, world_size: int) -> AutoChoice:
    """Every rank adopts rank 0's measured choice (ranks' own timings differ by noise)."""
    import torch.distributed as dist

    if world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
        return choice
    box = [choice]
    dist.broadcast_object_list(box, src=0)
    return box[0]
