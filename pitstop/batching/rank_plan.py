"""A rank's own share of an epoch's plan: under torchrun each rank holds the rows it trains.

`plan.build_plan` returns the whole epoch, every row of every step, and ranks take their
rows when micro-batches are cut (`plan.step_micro_batches` deals each step's rows
round-robin). With W ranks on a machine that is W copies of the whole plan. Here the same
step plan is built a block of whole steps at a time (`plan.step_plan_blocks`), each block
is laid out exactly as `build_plan` lays it out (the same random row order for pack), and
over every rank's rows of the block this counts what needs them all: the epoch's
efficiency (banner, `auto`), each step's trained tokens (the loss normaliser), its
narrowest row (a rank left without rows computes one filler row that wide) and, under
lockstep, the most micro-batches any rank gets. Then only this rank's rows are kept.

So a rank holds its share of the rows (8 bytes per sequence over W), a few numbers per
step, the shuffle (4 bytes per sequence) while planning, and one block; it gets the same
micro-batches, in the same order, as from the whole plan (tests/test_rank_plan.py). Each
rank still fills every row of the epoch (the fill is one pass in which each row depends on
the earlier ones), with its share of the machine's cores.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping

import numpy as np

from pitstop.batching import plan as plan_module
from pitstop.batching.plan import Plan, efficiency_key
from pitstop.batching.settings import BatchSettings
from pitstop.catalog.layouts import Layout

__all__ = ["build_rank_plans"]


@dataclasses.dataclass
class _Share:
    """One layout's rank share and all-rank step facts, a block at a time."""

    seqs: list[np.ndarray] = dataclasses.field(default_factory=list)
    row_sizes: list[np.ndarray] = dataclasses.field(default_factory=list)
    row_tokens: list[np.ndarray] = dataclasses.field(default_factory=list)
    rows_per_step: list[np.ndarray] = dataclasses.field(default_factory=list)
    rows_all: list[np.ndarray] = dataclasses.field(default_factory=list)
    tokens: list[np.ndarray] = dataclasses.field(default_factory=list)
    narrowest: list[np.ndarray] = dataclasses.field(default_factory=list)
    trained: list[np.ndarray] = dataclasses.field(default_factory=list)
    most: list[np.ndarray] = dataclasses.field(default_factory=list)
    efficiencies: list[plan_module.Efficiency] = dataclasses.field(default_factory=list)


def build_rank_plans(
    lengths: np.ndarray,
    *,
    settings: Mapping[Layout, BatchSettings],
    seed: int,
    epoch: int,
    rank: int,
    indices: np.ndarray | None = None,
    trained: np.ndarray | None = None,
    lockstep: bool = False,
) -> dict[Layout, Plan]:
    """`rank`'s share of epoch `epoch`'s plan in each layout of `settings` (one pass of the
    step plan for all of them), as `plan.build_plan` with the same arguments would deal it.

    Every settings value has the rank's world size and the same max_seq_len and
    tokens_per_step. A returned plan answers `step_micro_batches` for `rank` only, and
    `plan_efficiency` for its settings and `lockstep` with `lengths` (counted here over
    every rank); its `step_trained` is each step's trained tokens over every rank."""
    layouts = {Layout.parse(k): v for k, v in settings.items()}
    first = next(iter(layouts.values()))
    world, msl, tps = first.world_size, first.max_seq_len, first.tokens_per_step
    for s in layouts.values():
        if (s.world_size, s.max_seq_len, s.tokens_per_step) != (world, msl, tps):
            raise ValueError("every layout's settings need one world size and one step shape")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside world size {world}")
    store_lengths = np.asarray(lengths)
    store_trained = store_lengths if trained is None else np.asarray(trained)
    sub_lengths, sub_trained = plan_module.planned_facts(lengths, trained, indices, msl)
    base = plan_module.plan_key(sub_trained, sub_lengths, indices, msl, tps, seed, epoch)
    keys = {k: _rank_key(base, rank, lockstep, s) for k, s in layouts.items()}
    kept = {k: plan_module.kept_plan(keys[k], k) for k in layouts}
    if all(p is not None for p in kept.values()):
        return kept  # type: ignore[return-value]
    shares = {k: _Share() for k in layouts}
    rngs = {k: plan_module.layout_rng(seed, epoch) for k in layouts}
    blocks = plan_module.step_plan_blocks(sub_trained, sub_lengths, msl, tps, seed, epoch)
    shape = (epoch, seed, msl, tps)
    for block in blocks:
        for layout, s in layouts.items():
            whole = plan_module.laid_out(block, sub_lengths, layout, rngs[layout], indices, shape)
            _add_block(shares[layout], whole, s, rank, lockstep, store_lengths, store_trained)
    out = {}
    for layout, s in layouts.items():
        out[layout] = _assemble(shares[layout], layout, s, rank, lockstep, seed, epoch)
        object.__setattr__(out[layout], "key", keys[layout])
    return out


def _rank_key(base: bytes, rank: int, lockstep: bool, s: BatchSettings) -> bytes:
    what = (rank, s.world_size, lockstep, s.micro_batch_size, s.tokens_per_micro_batch)
    return hashlib.sha256(base + repr(what).encode()).digest()[:16]


def _add_block(
    share: _Share,
    whole: Plan,
    settings: BatchSettings,
    rank: int,
    lockstep: bool,
    lengths: np.ndarray,
    trained: np.ndarray,
) -> None:
    """Count a block of whole steps over every rank, and keep `rank`'s rows of it."""
    world = settings.world_size
    share.efficiencies.append(plan_module.block_efficiency(whole, settings, lockstep, lengths))
    rows_all = np.diff(whole.step_bounds)
    starts = whole.step_bounds[:-1]
    share.rows_all.append(rows_all)
    share.tokens.append(np.add.reduceat(whole.row_tokens, starts))  # a step has >= 1 row
    share.narrowest.append(np.minimum.reduceat(whole.row_tokens, starts))
    share.trained.append(whole.per_step_sums(trained))
    if lockstep:
        share.most.append(plan_module.micro_counts(whole, settings).max(axis=0))
    # step_micro_batches deals a step's rows round-robin: rank r gets rows r, r + W, ...
    step_of = np.repeat(np.arange(len(rows_all)), rows_all)
    mine = np.flatnonzero((np.arange(whole.n_rows) - starts[step_of]) % world == rank)
    flat, bounds = plan_module.gather_segments(whole.seqs, whole.row_bounds, mine)
    share.seqs.append(flat)
    share.row_sizes.append(np.diff(bounds))
    share.row_tokens.append(whole.row_tokens[mine])
    share.rows_per_step.append(np.bincount(step_of[mine], minlength=len(rows_all)))


def _assemble(
    share: _Share,
    layout: Layout,
    settings: BatchSettings,
    rank: int,
    lockstep: bool,
    seed: int,
    epoch: int,
) -> Plan:
    def cat(parts: list[np.ndarray], *, lead: int = 0) -> np.ndarray:
        """The parts one after another (after `lead` zeros), each part dropped once copied:
        the share is not held twice while it is put together."""
        out = np.zeros(lead + sum(len(x) for x in parts), dtype=np.int64)
        at = lead
        while parts:
            part = parts.pop(0)
            out[at : at + len(part)] = part
            at += len(part)
        return out

    def bounds(sizes: list[np.ndarray]) -> np.ndarray:
        out = cat(sizes, lead=1)
        np.cumsum(out, out=out)
        return out

    rows_all = cat(share.rows_all)
    plan = Plan(
        strategy=layout,
        epoch=epoch,
        seed=seed,
        max_seq_len=settings.max_seq_len,
        tokens_per_step=settings.tokens_per_step,
        seqs=cat(share.seqs),
        row_bounds=bounds(share.row_sizes),
        step_bounds=bounds(share.rows_per_step),
        row_tokens=cat(share.row_tokens),
        rank=rank,
        world=settings.world_size,
        step_rows_all=rows_all,
        step_tokens=cat(share.tokens),
        step_narrowest=cat(share.narrowest),
        step_trained=cat(share.trained),
        step_most=cat(share.most) if lockstep else None,
    )
    eff = plan_module.summed_efficiency(share.efficiencies, len(rows_all))
    plan.efficiencies[efficiency_key(settings, lockstep, with_lengths=True)] = eff
    return plan
