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
