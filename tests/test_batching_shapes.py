"""`micro_batch_rows` counts what the loader hands out: the row counts it gives equal the
ones found by walking every step's micro-batches (`step_micro_batches`, the loader's own)."""

from __future__ import annotations

import numpy as np
import pytest

from pitstop.batching.plan import build_plan, step_micro_batches
from pitstop.batching.settings import BatchSettings
from pitstop.batching.shapes import micro_batch_rows

MSL = 128


def _walked(plan, settings, rank, lockstep):
    specs = [
        s
        for step in range(plan.n_steps)
        for s in step_micro_batches(plan, step, settings, rank, lockstep=lockstep)
    ]
    return max(1, len(specs[0].rows)), {max(1, len(s.rows)) for s in specs}


@pytest.mark.parametrize("strategy", ["pack", "pad"])
@pytest.mark.parametrize("tps", [512, 640, 1152])
@pytest.mark.parametrize(
    ("micro", "world", "lockstep"),
    [
        ({"micro_batch_size": 2}, 1, False),
        ({"micro_batch_size": 3}, 1, False),
        ({"tokens_per_micro_batch": 256}, 1, False),
        ({"micro_batch_size": 2}, 2, False),
        ({"micro_batch_size": 2}, 3, True),
        ({"tokens_per_micro_batch": 384}, 2, True),
    ],
)
def test_the_counted_rows_are_the_walked_ones(strategy, tps, micro, world, lockstep):
    rng = np.random.default_rng(7)
    lengths = rng.integers(5, MSL + 1, size=600).astype(np.int64)
    plan = build_plan(lengths, strategy=strategy, max_seq_len=MSL, tokens_per_step=tps,
                      seed=1, epoch=0)  # fmt: skip
    s = BatchSettings(strategy, MSL, tps, world_size=world, **micro)
    for rank in range(world):
        got = micro_batch_rows(plan, s, rank, lockstep=lockstep)
        first, sizes = _walked(plan, s, rank, lockstep)
        assert got is not None
        assert (got.first, set(got.sizes)) == (first, sizes), (rank, got)


def test_bucket_rows_are_not_counted():
    lengths = np.full(50, 40, dtype=np.int64)
    plan = build_plan(lengths, strategy="bucket", max_seq_len=MSL, tokens_per_step=512,
                      seed=1, epoch=0)  # fmt: skip
    s = BatchSettings("bucket", MSL, 512, micro_batch_size=2)
    assert micro_batch_rows(plan, s) is None


@pytest.mark.parametrize("lockstep", [False, True])
def test_a_ranks_share_counts_as_the_whole_plan_walked(lockstep):
    """Under torchrun each rank keeps only its share of the plan (`build_rank_plans`): its
    counted row counts are the ones its own micro-batches have."""
    from pitstop.batching.rank_plan import build_rank_plans
    from pitstop.catalog.layouts import Layout

    rng = np.random.default_rng(3)
    lengths = rng.integers(5, MSL + 1, size=600).astype(np.int64)
    # Steps of ~16 rows dealt to 3 ranks in micro-batches of 3: without lockstep ranks 1
    # and 2 never get a one-row micro-batch; with it, FSDP's fillers give them some.
    s = BatchSettings("pack", MSL, 2048, micro_batch_size=3, world_size=3)
    for rank in range(3):
        (share,) = build_rank_plans(lengths, settings={Layout.parse("pack"): s}, seed=1, epoch=0,
                                    rank=rank, lockstep=lockstep).values()  # fmt: skip
        got = micro_batch_rows(share, s, rank, lockstep=lockstep)
        assert got is not None
        assert (got.first, set(got.sizes)) == _walked(share, s, rank, lockstep), rank
        if rank:
            assert (1 in got.sizes) is lockstep  # the case the test is for
