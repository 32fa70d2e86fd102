"""`--eval-data auto`'s held-out split, plans over an index subset, and FSDP lockstep micro-batches."""

from __future__ import annotations

import numpy as np
import pytest
from test_batching_support import long_tailed_lengths, make_store

from pitstop.batching.plan import build_plan, step_micro_batches
from pitstop.batching.resolve import loader_for
from pitstop.batching.settings import BatchSettings
from pitstop.batching.split import holdout_split
from pitstop.core.config import RunConfig
from pitstop.core.errors import ConfigError

MSL = 64


def test_holdout_is_whole_documents_disjoint_and_deterministic():
    # 500 documents of 1-3 sequences each (split long documents share a doc id).
    doc_ids = np.repeat(np.arange(500), np.random.default_rng(0).integers(1, 4, 500))
    a, b = holdout_split(doc_ids), holdout_split(doc_ids.copy())
    assert np.array_equal(a.eval, b.eval) and np.array_equal(a.train, b.train)  # stable
    assert len(np.intersect1d(a.train, a.eval)) == 0
    assert np.array_equal(np.union1d(a.train, a.eval), np.arange(len(doc_ids)))
    held_docs = set(doc_ids[a.eval].tolist())
    assert held_docs.isdisjoint(doc_ids[a.train].tolist())  # no chunk of an eval doc trains
    assert 2 <= a.n_eval_docs <= 25  # ~2% of 500
    # A document's side depends on it alone: dropping other documents never moves it.
    sub = doc_ids[doc_ids < 250]
    kept = {d for d in held_docs if d < 250}
    assert kept  # (were it empty, the split would fall back to the smallest hash)
    assert set(sub[holdout_split(sub).eval].tolist()) == kept


def test_holdout_of_a_tiny_corpus_keeps_one_document_each_side():
    s = holdout_split(np.array([0, 0, 1]))
    assert s.n_eval_docs == 1 and len(s.train) >= 1 and len(s.eval) >= 1
    with pytest.raises(ConfigError, match="at least 2 documents"):
        holdout_split(np.array([7, 7]))


@pytest.mark.parametrize("strategy", ["pack", "bucket", "pad"])
def test_plan_over_a_subset_covers_it_exactly_once(strategy):
    lengths = long_tailed_lengths(300, MSL)
    keep = np.sort(np.random.default_rng(1).choice(300, 240, replace=False))
    for epoch in (0, 1):
        plan = build_plan(lengths, strategy=strategy, max_seq_len=MSL, tokens_per_step=4 * MSL,
                          seed=3, epoch=epoch, indices=keep)  # fmt: skip
        assert np.array_equal(np.sort(plan.seqs), keep)
        assert int(plan.row_tokens.sum()) == int(lengths[keep].sum())
        assert all(t <= MSL for t in plan.row_tokens) if strategy != "bucket" else True


def test_loader_with_indices_trains_on_the_rest_only(tmp_path):
    store = make_store(tmp_path / "s", long_tailed_lengths(200, MSL), max_seq_len=MSL)
    split = holdout_split(np.asarray(store.doc_ids), share=0.1)
    cfg = RunConfig(max_seq_len=MSL, tokens_per_step=4 * MSL, micro_batch_size=2,
                    loader_workers=0, batching="pack", epochs=2)  # fmt: skip
    loader = loader_for(store, cfg, indices=split.train)
    per_epoch: dict[int, list[int]] = {0: [], 1: []}
    for step in range(loader.total_steps):
        epoch, _ = loader.locate(step)
        for spec in loader.micro_batches(step):
            per_epoch[epoch] += [int(i) for r in spec.rows for i in r]
    for seen in per_epoch.values():
        assert sorted(seen) == split.train.tolist()  # every kept sequence exactly once per epoch
    state = loader.state_dict()
    assert state["n_sequences"] == len(split.train)


def test_lockstep_gives_every_rank_as_many_micro_batches():
    lengths = long_tailed_lengths(101, MSL, seed=2)
    cfg = RunConfig(max_seq_len=MSL, tokens_per_step=6 * MSL, micro_batch_size=1)
    for strategy in ("pack", "bucket"):
        settings = BatchSettings.from_config(cfg, world_size=4, strategy=strategy)
        plan = build_plan(lengths, strategy=strategy, max_seq_len=MSL,
                          tokens_per_step=6 * MSL, seed=0, epoch=0)  # fmt: skip
        uneven = False
        for step in range(plan.n_steps):
            loose = [len(step_micro_batches(plan, step, settings, r)) for r in range(4)]
            tight = [step_micro_batches(plan, step, settings, r, lockstep=True) for r in range(4)]
            uneven |= len(set(loose)) > 1
            assert len({len(t) for t in tight}) == 1
            # the padding is filler only: the same rows as without lockstep
            for r in range(4):
                assert sum(len(s.rows) for s in tight[r]) == sum(
                    len(s.rows) for s in step_micro_batches(plan, step, settings, r)
                )
        assert uneven  # the case lockstep exists for did occur
