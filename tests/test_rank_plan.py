"""A rank's share of the plan (issue 32: every rank holds only its part): each rank gets
exactly the micro-batches the whole plan deals it, in the same order, with the same fillers
and lockstep padding; the efficiency, each step's trained tokens and the step count are
every rank's, counted while the rows went by; and a share refuses what it cannot answer
(another rank, a sum over only its own rows)."""

from __future__ import annotations

import numpy as np
import pytest
from test_batching_support import long_tailed_lengths

from pitstop.batching import plan as plan_mod
from pitstop.batching.plan import build_plan, plan_efficiency, step_micro_batches
from pitstop.batching.rank_plan import build_rank_plans
from pitstop.batching.settings import BatchSettings

MSL = 128
SPLITS = [{"micro_batch_size": 2}, {"tokens_per_micro_batch": 3 * MSL}]


def _same_specs(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.width == y.width and len(x.rows) == len(y.rows)
        for r, q in zip(x.rows, y.rows, strict=True):
            assert np.array_equal(r, q)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("lockstep", [False, True])
@pytest.mark.parametrize("split", SPLITS)
def test_each_rank_gets_what_the_whole_plan_deals_it(monkeypatch, world, lockstep, split) -> None:
    monkeypatch.setattr(plan_mod, "FILL_CHUNK", 700)  # several chunks and blocks of steps
    monkeypatch.setattr(plan_mod, "BLOCK", 300)
    lengths = long_tailed_lengths(2500, MSL, seed=2).astype(np.uint32)
    trained = np.maximum(0, lengths.astype(np.int64) - 1).astype(np.uint32)
    subset = np.flatnonzero(np.random.default_rng(1).random(len(lengths)) < 0.9)
    layouts = ("pack", "bucket", "pad")
    for indices in (None, subset):
        settings = {k: BatchSettings(k, MSL, 5 * MSL, world_size=world, **split) for k in layouts}
        kw = dict(seed=5, epoch=1, indices=indices, trained=trained)
        shares = [
            build_rank_plans(lengths, settings=settings, rank=r, lockstep=lockstep, **kw)
            for r in range(world)
        ]
        for layout in layouts:
            plan_mod.release_step_plans()
            whole = build_plan(
                lengths, strategy=layout, max_seq_len=MSL, tokens_per_step=5 * MSL, **kw
            )
            s = settings[layout]
            want_eff = plan_efficiency(whole, s, lockstep=lockstep, lengths=lengths)
            targets = whole.per_step_sums(trained)
            held = 0
            for r in range(world):
                mine = shares[r][layout]
                assert mine.n_steps == whole.n_steps > 5
                assert plan_efficiency(mine, s, lockstep=lockstep, lengths=lengths) == want_eff
                assert np.array_equal(mine.step_trained, targets)
                for step in range(whole.n_steps):
                    _same_specs(
                        step_micro_batches(mine, step, s, r, lockstep=lockstep),
                        step_micro_batches(whole, step, s, r, lockstep=lockstep),
                    )
                held += len(mine.seqs)
            assert held == len(whole.seqs)  # the shares partition the epoch's sequences


def test_a_share_refuses_what_needs_the_other_ranks_rows() -> None:
    lengths = long_tailed_lengths(600, MSL, seed=4)
    s = BatchSettings("bucket", MSL, 4 * MSL, world_size=2, micro_batch_size=2)
    mine = build_rank_plans(lengths, settings={"bucket": s}, seed=0, epoch=0, rank=1)["bucket"]
    with pytest.raises(ValueError, match="rank 1 of 2 asked for rank 0"):
        step_micro_batches(mine, 0, s, 0)
    with pytest.raises(ValueError, match="step_trained"):
        mine.per_step_sums(lengths)  # this rank's rows only: a wrong loss normaliser
    with pytest.raises(ValueError, match="counted when it is built"):
        plan_efficiency(mine, s, lockstep=True, lengths=lengths)  # not what it was built for
    with pytest.raises(ValueError, match="without lockstep"):
        step_micro_batches(mine, 0, s, 1, lockstep=True)
    with pytest.raises(ValueError, match="outside world size"):
        build_rank_plans(lengths, settings={"bucket": s}, seed=0, epoch=0, rank=2)


def test_the_loader_of_a_rank_holds_its_share(tmp_path) -> None:
    """Under several ranks the loader plans this rank's share and normalises each step by
    every rank's trained tokens: the same batches and normalisers as dealt from the whole
    plan."""
    from test_batching_support import make_store

    from pitstop.batching.collate import collate
    from pitstop.batching.loader import LoaderOptions, MicroBatchLoader, sequence_targets

    store = make_store(tmp_path / "s", long_tailed_lengths(900, 64, seed=9), max_seq_len=64)
    s = BatchSettings("pack", 64, 256, micro_batch_size=2, world_size=2)
    targets = sequence_targets(store)
    plan_mod.release_step_plans()
    whole = build_plan(
        store.lengths,
        strategy="pack",
        max_seq_len=64,
        tokens_per_step=256,
        seed=LoaderOptions().seed,
        epoch=0,
        trained=targets,
    )
    per_step = whole.per_step_sums(targets)
    for rank in range(2):
        loader = MicroBatchLoader(store, s, LoaderOptions(workers=0), rank=rank)
        assert loader.plan(0).rank == rank and len(loader.plan(0).seqs) < len(store.lengths)
        want = [
            (step, spec)
            for step in range(whole.n_steps)
            for spec in step_micro_batches(whole, step, s, rank)
        ]
        got = list(loader)
        assert len(got) == len(want)
        for batch, (step, spec) in zip(got, want, strict=True):
            assert batch["meta"].step == step and batch["meta"].step_targets == per_step[step]
            ref = collate(store.tokens, store.mask, store.offsets, spec, store.pad_id)
            assert batch["input_ids"].equal(ref["input_ids"])
