"""Bucket's plan efficiency counted over rows and micro-batches in numpy (issue 32), not by
walking every row of every rank's micro-batches: the same positions, micro-batches and
attention squares as the walk, for every split, world size and lockstep."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_batching_support import long_tailed_lengths

from pitstop.batching.plan import _counted, _sorted_rows_counts, build_plan
from pitstop.batching.settings import BatchSettings

MSL = 128
SPLITS = [
    {"micro_batch_size": 1},
    {"micro_batch_size": 3},
    {"tokens_per_micro_batch": 5 * MSL},
    {"tokens_per_micro_batch": MSL + 1},
    {"tokens_per_micro_batch": 2 * MSL - 7},
]
# long-tailed; and a last step with fewer rows than ranks (fillers)
CORPORA = [
    (long_tailed_lengths(3000, MSL, seed=1), 8 * MSL),
    (np.array([MSL] * 9 + [5] * 3), 4 * MSL),
]


def _plan(lengths: np.ndarray, tps: int, epoch: int = 0):
    return build_plan(
        lengths, strategy="bucket", max_seq_len=MSL, tokens_per_step=tps, seed=0, epoch=epoch
    )


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("lockstep", [False, True])
@pytest.mark.parametrize("split", SPLITS)
def test_bucket_counts_equal_walking_every_micro_batch(world, lockstep, split) -> None:
    for lengths, tps in CORPORA:
        p = _plan(lengths, tps)
        s = BatchSettings("bucket", MSL, tps, world_size=world, **split)
        got = _sorted_rows_counts(p, s, lockstep)
        assert got == _counted(p, s, lockstep)
        assert got[1] >= p.n_steps * world  # every rank computes something each step


def test_rows_not_longest_first_are_walked() -> None:
    lengths, tps = CORPORA[0]
    p = _plan(lengths, tps)
    shuffled = np.random.default_rng(0).permutation(p.row_tokens)
    q = dataclasses.replace(p, row_tokens=shuffled)  # rows no longer longest first in a step
    s = BatchSettings("bucket", MSL, tps, world_size=2, tokens_per_micro_batch=3 * MSL)
    assert _sorted_rows_counts(q, s, True) == _counted(q, s, True)
    assert _sorted_rows_counts(q, s, True) != _sorted_rows_counts(p, s, True)


def _walked_starts(widths: list[int], step_first: list[bool], budget: int) -> list[int]:
    """The row-by-row walk `_greedy_starts` replaced (kept here as its reference)."""
    starts, n, i = [], len(widths), 0
    while i < n:
        starts.append(i)
        end = min(n, i + max(1, budget // widths[i]))
        i += 1
        while i < end and not step_first[i]:
            i += 1
    return starts


@pytest.mark.parametrize("seed", range(6))
def test_greedy_starts_equal_the_row_by_row_walk(seed: int) -> None:
    from pitstop.batching.plan import _greedy_starts

    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 400))
    widths = rng.integers(1, MSL + 1, n)
    first = rng.random(n) < rng.choice([0.02, 0.2, 0.9])
    first[0] = bool(seed % 2) or first[0]  # a first row that is not marked: still a start
    budget = int(rng.choice([1, MSL // 2, MSL, 5 * MSL]))
    got = _greedy_starts(widths, first, budget)
    assert got.tolist() == _walked_starts(widths.tolist(), first.tolist(), budget)
    assert _greedy_starts(np.zeros(0, np.int64), np.zeros(0, bool), budget).tolist() == []


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("lockstep", [False, True])
@pytest.mark.parametrize("split", SPLITS)
def test_pad_counted_from_buckets_rows_equals_its_own_plan(world, lockstep, split) -> None:
    """`batching: auto` counts pad from bucket's plan (the same rows, padded to
    max_seq_len) instead of laying pad out: the counts must be pad's own."""
    for lengths, tps in CORPORA:
        s = BatchSettings("pad", MSL, tps, world_size=world, **split)
        pad = build_plan(
            lengths, strategy="pad", max_seq_len=MSL, tokens_per_step=tps, seed=0, epoch=0
        )
        from_bucket = dataclasses.replace(_plan(lengths, tps), strategy="pad")
        from pitstop.batching.plan import plan_efficiency

        assert plan_efficiency(from_bucket, s, lockstep=lockstep) == plan_efficiency(
            pad, s, lockstep=lockstep
        )
