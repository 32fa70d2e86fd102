"""How many rows the micro-batches of a plan hold, counted without walking its steps: what
decides how many graphs torch.compile builds for a run (`probe.compile_graphs`).

In the fixed-width layouts (pack, pad) every micro-batch is `max_seq_len` wide, so its only
varying dimension is its row count. A step's rows are dealt round-robin to the ranks and cut
into micro-batches of `k` rows (`plan.step_micro_batches`), so a rank's micro-batches of a
step hold `k` rows and then the remainder; a rank left without rows gets a one-row filler,
as do the lockstep fillers that keep FSDP's ranks at the same count. All of that follows
from the rows per step, in numpy: start-up stays flat in the data's size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pitstop.batching.plan import Plan
from pitstop.batching.settings import BatchSettings
from pitstop.catalog.layouts import Layout


@dataclass(frozen=True)
class MicroBatchRows:
    """The row counts of a rank's micro-batches over a plan (fixed-width layouts)."""

    first: int  # the first micro-batch's rows
    sizes: frozenset[int]  # every row count that occurs


def micro_batch_rows(
    plan: Plan, settings: BatchSettings, rank: int = 0, *, lockstep: bool = False
) -> MicroBatchRows | None:
    """The row counts `step_micro_batches` hands rank `rank` over `plan`; None where rows are
    as wide as their longest (bucket: the width varies too) or the plan has no steps."""
    if not Layout.parse(plan.strategy).fixed_rows or plan.n_steps == 0:
        return None
    world = settings.world_size
    per_step = np.diff(np.asarray(plan.step_bounds, dtype=np.int64))
    if settings.micro_batch_size is not None:
        k = settings.micro_batch_size
    else:
        assert settings.tokens_per_micro_batch is not None
        k = max(1, settings.tokens_per_micro_batch // plan.max_seq_len)

    def rows_of(r: int) -> np.ndarray:  # rows r0 + r, r0 + r + world, ... of each step
        return np.maximum(0, (per_step - r + world - 1) // world)

    mine = per_step if plan.rank is not None else rows_of(rank)  # a share: its own rows
    sizes: set[int] = set()
    if (mine >= k).any():
        sizes.add(k)
    rest = mine % k
    sizes.update(int(x) for x in np.unique(rest[rest > 0]))
    if (mine == 0).any():
        sizes.add(1)  # a filler row
    if lockstep and world > 1:  # fillers up to the rank with the most micro-batches
        most = plan.step_most
        if most is None:
            most = np.max([np.maximum(1, -(-rows_of(r) // k)) for r in range(world)], axis=0)
        if (np.maximum(1, -(-mine // k)) < most).any():
            sizes.add(1)
    first = int(min(k, mine[0])) or 1
    return MicroBatchRows(first, frozenset(sizes))
