"""The epoch plan: which sequences form which optimizer step, then how each step is laid out.

Hand-written because no library plans at the level of the optimizer step: samplers
in torch, HF and TRL batch by micro-batch, so changing the micro-batch size changes
which documents share a step (and the tuner would be comparing different training
math). Here planning has two stages:

1. **The step plan** (`plan_steps`) depends only on (trained tokens per sequence,
   seed, epoch, tokens_per_step): sequences shuffled by (seed, epoch), cut greedily
   into steps of at most ``tokens_per_step`` trained (loss-target) tokens. It does
   not depend on the layout, the micro-batch size, the loader workers or the ranks.
2. **The layout** (the strategy) only arranges each step's sequences into rows:

   - ``pack``: best-fit-decreasing of the step's sequences into rows of max_seq_len,
     rows padded to max_seq_len (static shapes for torch.compile and CUDA graphs).
   - ``bucket``: one sequence per row, the step's rows sorted by length, so each
     micro-batch pads only to its own longest row.
   - ``pad``: one sequence per row in planned order, every row padded to max_seq_len.

So every layout trains the same documents in the same step and the same trained
tokens per step: the losses differ only by floating-point summation order, and
`auto`/`tune` compare like with like. Micro-batches and ranks are cut from each
step afterwards (`step_micro_batches`). Every sequence appears exactly once per epoch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pitstop.batching.settings import BatchSettings, Strategy
from pitstop.packing import bfd_arrays

__all__ = [
    "Efficiency",
    "MicroBatchSpec",
    "Plan",
    "build_plan",
    "measure_efficiency",
    "plan_efficiency",
    "plan_steps",
    "step_micro_batches",
]

# Seeds the step plan's shuffle and pack's tie-breaks; the same for every layout.
_STEP_PLAN_CODE = 7


@dataclass(frozen=True)
class Plan:
    """One epoch, as flat arrays (cheap to build, pickle and index for millions of sequences).

    Row r holds sequences ``seqs[row_bounds[r]:row_bounds[r+1]]``; step s holds rows
    ``step_bounds[s]:step_bounds[s+1]``. ``row_tokens[r]`` is row r's real token count.
    """

    strategy: Strategy
    epoch: int
    seed: int
    max_seq_len: int
    tokens_per_step: int
    seqs: np.ndarray  # int64 [n_sequences]
    row_bounds: np.ndarray  # int64 [n_rows + 1]
    step_bounds: np.ndarray  # int64 [n_steps + 1]
    row_tokens: np.ndarray  # int64 [n_rows]

    @property
    def n_steps(self) -> int:
        return len(self.step_bounds) - 1

    @property
    def n_rows(self) -> int:
        return len(self.row_bounds) - 1

    def step_rows(self, step: int) -> list[np.ndarray]:
        """Sequence ids of each row of `step`."""
        r0, r1 = int(self.step_bounds[step]), int(self.step_bounds[step + 1])
        b = self.row_bounds
        return [self.seqs[b[r] : b[r + 1]] for r in range(r0, r1)]

    def step_seq_bounds(self) -> np.ndarray:
        """int64 [n_steps + 1]: step s holds ``seqs[out[s]:out[s+1]]``."""
        return self.row_bounds[self.step_bounds]

    def per_step_sums(self, per_seq: np.ndarray) -> np.ndarray:
        """Sum of a per-sequence quantity (e.g. target tokens) over each step: int64 [n_steps]."""
        vals = np.asarray(per_seq, dtype=np.int64)[self.seqs]
        csum = np.concatenate([[0], np.cumsum(vals)])
        return np.diff(csum[self.step_seq_bounds()])


def _rng(seed: int, epoch: int) -> np.random.Generator:
    # Seeded by (seed, epoch) only: epoch e of a run is reproducible on its own (resuming
    # mid-run is exact without saving any RNG state), and no layout changes the steps.
    return np.random.default_rng([seed, epoch, _STEP_PLAN_CODE])


def _gather(
    flat: np.ndarray, bounds: np.ndarray, order: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Reorder the segments ``flat[bounds[i]:bounds[i+1]]`` into `order`; returns (flat, bounds)."""
    sizes = np.diff(bounds)[order]
    new_bounds = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(sizes, out=new_bounds[1:])
    idx = np.repeat(bounds[:-1][order] - new_bounds[:-1], sizes) + np.arange(new_bounds[-1])
    return flat[idx], new_bounds


def _greedy_cut(weights: np.ndarray, budget: int) -> np.ndarray:
    """Step boundaries over `weights` (in order): each step takes sequences while its total ≤ budget.

    A sequence above the budget alone forms a step (settings keep max_seq_len ≤
    tokens_per_step, so that does not happen in practice).
    """
    csum = np.cumsum(weights)
    ends = [0]
    base = 0
    n = len(weights)
    while ends[-1] < n:
        end = int(np.searchsorted(csum, base + budget, side="right"))
        end = max(end, ends[-1] + 1)
        ends.append(end)
        base = int(csum[end - 1])
    return np.asarray(ends, dtype=np.int64)


def plan_steps(
    trained: np.ndarray, *, tokens_per_step: int, seed: int, epoch: int
) -> tuple[np.ndarray, np.ndarray]:
    """The step plan: ``(order, bounds)``, step s = positions ``order[bounds[s]:bounds[s+1]]``.

    `trained` holds each sequence's trained (loss-target) tokens; a step takes shuffled
    sequences while its trained tokens stay ≤ `tokens_per_step`. Positions index `trained`.
    """
    trained = np.asarray(trained, dtype=np.int64)
    n = len(trained)
    order = _rng(seed, epoch).permutation(n).astype(np.int64)
    bounds = _greedy_cut(trained[order], tokens_per_step) if n else np.zeros(1, np.int64)
    return order, bounds


def _layout(
    order: np.ndarray,
    step_bounds: np.ndarray,
    lengths: np.ndarray,
    strategy: Strategy,
    msl: int,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each step's positions arranged into rows: ``(seqs, row_bounds, step_bounds)``."""
    n_steps = len(step_bounds) - 1
    if strategy == "pack":
        parts: list[np.ndarray] = []
        row_sizes: list[np.ndarray] = []
        rows_per_step = np.zeros(n_steps, np.int64)
        for s in range(n_steps):
            items = order[step_bounds[s] : step_bounds[s + 1]]
            flat, bounds = bfd_arrays(lengths[items], msl)
            # BFD opens rows longest-documents first; shuffled, ranks dealt rows
            # round-robin get a fair mix of documents.
            flat, bounds = _gather(flat, bounds, rng.permutation(len(bounds) - 1))
            parts.append(items[flat])
            row_sizes.append(np.diff(bounds))
            rows_per_step[s] = len(bounds) - 1
        seqs = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        sizes = np.concatenate(row_sizes) if row_sizes else np.zeros(0, np.int64)
        row_bounds = np.r_[0, np.cumsum(sizes)].astype(np.int64)
        return seqs, row_bounds, np.r_[0, np.cumsum(rows_per_step)].astype(np.int64)
    if strategy == "bucket":
        # Longest first within each step (ties keep the planned order), so micro-batches
        # cut from a step hold rows of similar length and pad little.
        step_of = np.repeat(np.arange(n_steps), np.diff(step_bounds))
        order = order[np.lexsort((np.arange(len(order)), -lengths[order], step_of))]
    elif strategy != "pad":
        raise ValueError(f"unknown batching strategy {strategy!r}")
    return order, np.arange(len(order) + 1, dtype=np.int64), step_bounds


def build_plan(
    lengths: np.ndarray,
    *,
    strategy: Strategy,
    max_seq_len: int,
    tokens_per_step: int,
    seed: int,
    epoch: int,
    indices: np.ndarray | None = None,
    trained: np.ndarray | None = None,
) -> Plan:
    """The deterministic plan of one epoch (same arguments, same plan, on every rank).

    `trained` (int64, one per store sequence) is each sequence's trained-token count,
    the unit of `tokens_per_step` (the loader passes `sequence_targets`); None counts
    every token. `indices` (int64, sorted) restricts the plan to those sequence ids of
    the store (the rest, e.g. a held-out evaluation share, never appears); `seqs` in
    the plan are still store ids, each index exactly once per epoch. Only the rows
    depend on `strategy`: which sequences form each step does not.
    """
    all_lengths = np.asarray(lengths, dtype=np.int64)
    all_trained = all_lengths if trained is None else np.asarray(trained, dtype=np.int64)
    if indices is not None:
        idx = np.asarray(indices, np.int64)
        all_lengths, all_trained = all_lengths[idx], all_trained[idx]
    lengths = all_lengths
    n = len(lengths)
    if n and lengths.max() > max_seq_len:
        raise ValueError(
            f"a sequence has {int(lengths.max())} tokens, above max_seq_len {max_seq_len}"
        )  # the store was prepared for a longer max length: a caller bug, the loader checks first
    order, step_seq_bounds = plan_steps(
        all_trained, tokens_per_step=tokens_per_step, seed=seed, epoch=epoch
    )
    rng = np.random.default_rng([seed, epoch, _STEP_PLAN_CODE + 1])  # pack's row order only
    seqs, row_bounds, step_bounds = _layout(
        order, step_seq_bounds, lengths, strategy, max_seq_len, rng
    )
    csum = np.concatenate([[0], np.cumsum(lengths[seqs])])
    if indices is not None:
        seqs = np.asarray(indices, np.int64)[seqs]  # positions in the subset -> store ids
    return Plan(
        strategy=strategy,
        epoch=epoch,
        seed=seed,
        max_seq_len=max_seq_len,
        tokens_per_step=tokens_per_step,
        seqs=np.asarray(seqs, dtype=np.int64),
        row_bounds=row_bounds,
        step_bounds=step_bounds,
        row_tokens=np.diff(csum[row_bounds]),
    )


@dataclass(frozen=True)
class MicroBatchSpec:
    """One micro-batch before reading: rows of sequence ids, padded to `width` positions.

    A *filler* has no rows: a rank that got no rows of a step computes one row of
    padding only (zero targets), so every rank runs the same steps in lockstep.
    """

    rows: tuple[np.ndarray, ...]
    width: int  # T, positions per row

    @property
    def filler(self) -> bool:
        return not self.rows

    @property
    def n_positions(self) -> int:
        return max(1, len(self.rows)) * self.width


def step_micro_batches(
    plan: Plan, step: int, settings: BatchSettings, rank: int = 0, *, lockstep: bool = False
) -> list[MicroBatchSpec]:
    """Rank `rank`'s micro-batches of `step`: rows dealt round-robin, then split by the micro setting.

    Round-robin dealing keeps ranks balanced when bucket rows are sorted by length.
    A rank left without rows (a step with fewer rows than ranks, e.g. the last one of
    an epoch) gets a single filler micro-batch: no data is dropped or repeated, and
    the step's loss normaliser (its target count) is unchanged.

    `lockstep=True` appends filler micro-batches so every rank has as many as the rank
    with the most: FSDP gathers parameters in every forward, a collective all ranks
    must join the same number of times (DDP communicates once per step and needs no
    such padding).
    """
    specs = _rank_micro_batches(plan, step, settings, rank)
    if lockstep and settings.world_size > 1:
        most = max(
            len(_rank_micro_batches(plan, step, settings, r)) for r in range(settings.world_size)
        )
        fixed = plan.strategy in ("pack", "pad")
        filler = MicroBatchSpec((), plan.max_seq_len if fixed else _filler_width(plan, step))
        specs = specs + [filler] * (most - len(specs))
    return specs


def _filler_width(plan: Plan, step: int) -> int:
    r0, r1 = int(plan.step_bounds[step]), int(plan.step_bounds[step + 1])
    return int(plan.row_tokens[r0:r1].min()) if r1 > r0 else plan.max_seq_len


def _rank_micro_batches(
    plan: Plan, step: int, settings: BatchSettings, rank: int
) -> list[MicroBatchSpec]:
    world = settings.world_size
    r0, r1 = int(plan.step_bounds[step]), int(plan.step_bounds[step + 1])
    rows_idx = list(range(r0 + rank, r1, world))
    fixed = plan.strategy in ("pack", "pad")
    msl = plan.max_seq_len
    if not rows_idx:
        width = msl if fixed else _filler_width(plan, step)
        return [MicroBatchSpec((), width)]
    b = plan.row_bounds
    rows = [plan.seqs[b[r] : b[r + 1]] for r in rows_idx]
    lens = [int(plan.row_tokens[r]) for r in rows_idx]
    groups: list[tuple[int, int]] = []  # [start, end) into rows
    if settings.micro_batch_size is not None:
        k = settings.micro_batch_size
        groups = [(i, min(i + k, len(rows))) for i in range(0, len(rows), k)]
    else:
        budget = settings.tokens_per_micro_batch
        assert budget is not None
        start, longest = 0, 0
        for i, length in enumerate(lens):
            w = msl if fixed else max(longest, length)
            if i > start and (i - start + 1) * w > budget:
                groups.append((start, i))
                start, w = i, (msl if fixed else length)
            longest = w
        groups.append((start, len(rows)))
    return [MicroBatchSpec(tuple(rows[a:e]), msl if fixed else max(lens[a:e])) for a, e in groups]


@dataclass(frozen=True)
class Efficiency:
    """Real tokens vs positions computed for a plan under a micro-batch setting."""

    seen_tokens: int  # non-padding input tokens
    positions: int  # every position computed, padding and filler rows included
    steps: int
    micro_batches: int

    @property
    def packing_efficiency(self) -> float:
        return self.seen_tokens / self.positions if self.positions else 1.0

    @property
    def padding_waste(self) -> float:
        return 1.0 - self.packing_efficiency


def plan_efficiency(plan: Plan, settings: BatchSettings, *, lockstep: bool = False) -> Efficiency:
    """Efficiency of `plan` over all ranks' micro-batches, without reading tokens or running a model."""
    positions = micro = 0
    for step in range(plan.n_steps):
        for rank in range(settings.world_size):
            specs = step_micro_batches(plan, step, settings, rank, lockstep=lockstep)
            micro += len(specs)
            positions += sum(s.n_positions for s in specs)
    return Efficiency(int(plan.row_tokens.sum()), positions, plan.n_steps, micro)


def measure_efficiency(
    lengths: np.ndarray,
    settings: BatchSettings,
    *,
    seed: int = 0,
    epoch: int = 0,
    trained: np.ndarray | None = None,
) -> Efficiency:
    """Packing efficiency and padding waste of a strategy for these sequence lengths."""
    plan = build_plan(
        lengths,
        trained=trained,
        strategy=settings.strategy,
        max_seq_len=settings.max_seq_len,
        tokens_per_step=settings.tokens_per_step,
        seed=seed,
        epoch=epoch,
    )
    return plan_efficiency(plan, settings)
