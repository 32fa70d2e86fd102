"""Planning in bounded memory (issue 32): the step plan is built chunk by chunk as the fill
hands chunks over, and every numpy pass of laying out and counting goes a block of whole
steps at a time (plan.BLOCK). Blocks must change nothing: the plans, their efficiency and
their per-step sums equal the ones computed in one block, for every layout, a held-out
subset, several ranks and lockstep, and the store's int32 facts plan as int64 copies do."""

from __future__ import annotations

import numpy as np
import pytest
from test_batching_support import long_tailed_lengths

from pitstop.batching import plan as plan_mod
from pitstop.batching.plan import build_plan, plan_efficiency
from pitstop.batching.settings import BatchSettings

MSL = 128
FIELDS = ("seqs", "row_bounds", "step_bounds", "row_tokens")


def _everything(lengths: np.ndarray, trained: np.ndarray, strategy: str, indices=None):
    plan_mod.release_step_plans()
    plan = build_plan(
        lengths,
        trained=trained,
        strategy=strategy,
        max_seq_len=MSL,
        tokens_per_step=6 * MSL,
        seed=4,
        epoch=1,
        indices=indices,
    )
    effs = []
    for world in (1, 3):
        for split in ({"micro_batch_size": 2}, {"tokens_per_micro_batch": 3 * MSL}):
            for lockstep in (False, True):
                s = BatchSettings(strategy, MSL, 6 * MSL, world_size=world, **split)
                effs.append(plan_efficiency(plan, s, lockstep=lockstep, lengths=lengths))
    return plan, effs, plan.per_step_sums(trained)


@pytest.mark.parametrize("strategy", ["pack", "bucket", "pad"])
@pytest.mark.parametrize("block", [1, 7, 500])
def test_blocks_and_chunks_change_no_plan_and_no_count(monkeypatch, strategy, block) -> None:
    lengths = long_tailed_lengths(5000, MSL, seed=3).astype(np.int64)
    trained = np.maximum(0, lengths - 1 - np.random.default_rng(5).integers(0, 3, len(lengths)))
    subset = np.flatnonzero(np.random.default_rng(6).random(len(lengths)) < 0.8)
    for indices in (None, subset):
        whole = _everything(lengths, trained, strategy, indices)
        with monkeypatch.context() as m:
            m.setattr(plan_mod, "FILL_CHUNK", 1200)  # several chunks, streamed in order
            m.setattr(plan_mod, "FILL_WORKERS", 1)
            chunked_whole = _everything(lengths, trained, strategy, indices)  # one block
            m.setattr(plan_mod, "BLOCK", block)
            m.setattr(plan_mod, "FILL_WORKERS", 3)
            blocked = _everything(lengths, trained, strategy, indices)
        plan_mod.release_step_plans()
        # FILL_CHUNK changes the plan (by design: the loader refuses a resume across it);
        # blocks and processes do not.
        for name in FIELDS:
            assert np.array_equal(getattr(blocked[0], name), getattr(chunked_whole[0], name))
        assert blocked[1] == chunked_whole[1] and np.array_equal(blocked[2], chunked_whole[2])
        with monkeypatch.context() as m:  # one chunk (the default): the blocks alone
            m.setattr(plan_mod, "BLOCK", block)
            small = _everything(lengths, trained, strategy, indices)
        for name in FIELDS:
            assert np.array_equal(getattr(small[0], name), getattr(whole[0], name)), name
        assert small[1] == whole[1] and np.array_equal(small[2], whole[2])
        assert blocked[0].n_steps > 10


@pytest.mark.parametrize("dtype", [np.uint32, np.int32])
@pytest.mark.parametrize("strategy", ["pack", "bucket", "pad"])
def test_32_bit_facts_plan_as_int64_copies_do(strategy, dtype) -> None:
    """The loader and `auto` plan over the store's memory-mapped uint32 facts, uncopied."""
    lengths = long_tailed_lengths(3000, MSL, seed=8).astype(np.int64)
    trained = np.maximum(0, lengths - 2)
    wide = _everything(lengths, trained, strategy)
    narrow = _everything(lengths.astype(dtype), trained.astype(dtype), strategy)
    for name in FIELDS:
        assert getattr(narrow[0], name).dtype == np.int64
        assert np.array_equal(getattr(narrow[0], name), getattr(wide[0], name)), name
    assert narrow[1] == wide[1] and np.array_equal(narrow[2], wide[2])


def test_the_shuffle_is_the_same_in_half_the_bytes(monkeypatch) -> None:
    """The step plan shuffles an int32 arange in its own memory map: the same permutation
    as Generator.permutation(n); released pages read as zeros, the rest is untouched."""
    monkeypatch.setattr(plan_mod, "BLOCK", 1000)  # the arange written in several blocks
    for n in (1, 2, 1000, 65_537):
        a = plan_mod._rng(3, 2).permutation(n)
        b, release = plan_mod._shuffle(n, 3, 2)
        assert b.dtype == np.int32 and np.array_equal(a, b)
        release(0, n // 2)
        kept = b[n // 2 :].copy()
        assert np.array_equal(kept, a[n // 2 :])
        if n * 4 >= 2 * 4096:  # whole pages inside the released range came back as zeros
            assert not b[: 4096 // 4].any()
