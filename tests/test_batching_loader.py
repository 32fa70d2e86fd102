"""Collate conventions and the loader: coverage, multi-epoch, resume, ranks, workers, errors."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch
from test_batching_support import long_tailed_lengths, make_store

from pitstop.batching.collate import collate
from pitstop.batching.loader import LoaderError, default_loader_workers
from pitstop.batching.plan import MicroBatchSpec
from pitstop.batching.resolve import loader_for
from pitstop.core.config import RunConfig

MSL = 64


@pytest.fixture()
def store(tmp_path):
    return make_store(tmp_path / "s", long_tailed_lengths(400, MSL), max_seq_len=MSL)


def cfg(**kw):
    base = {
        "max_seq_len": MSL,
        "tokens_per_step": 4 * MSL,
        "micro_batch_size": 2,
        "loader_workers": 0,
    }
    return RunConfig(**{**base, **kw})


def seq_tokens(store, i):
    a, b = int(store.offsets[i]), int(store.offsets[i + 1])
    return np.asarray(store.tokens[a:b], dtype=np.int64)


def test_collate_packed_row_conventions(tmp_path):
    s = make_store(tmp_path / "c", [5, 3, 4], max_seq_len=16, first_is_target=True)
    spec = MicroBatchSpec((np.array([0, 1, 2]), np.array([1])), width=16)
    b = collate(s.tokens, s.mask, s.offsets, spec, pad_id=2)
    ids, labels, pos = b["input_ids"], b["labels"], b["position_ids"]
    assert ids.shape == labels.shape == pos.shape == (2, 16) and ids.dtype == torch.long
    assert pos[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7]  # pad continues
    assert pos[1].tolist() == list(range(16))
    # No document's first token is a target (the store even claims they are), so the
    # previous document's last position never predicts the next document.
    for col in (0, 5, 8):
        assert labels[0, col] == -100
    assert (labels[0, 12:] == -100).all() and (ids[0, 12:] == 2).all()
    expect = np.where(np.asarray(s.mask[:12], bool), np.asarray(s.tokens[:12], np.int64), -100)
    expect[[0, 5, 8]] = -100
    assert labels[0, :12].tolist() == expect.tolist()
    assert ids[1, :3].tolist() == seq_tokens(s, 1).tolist()
    assert b["cu_seqlens"].dtype == torch.int32
    assert b["cu_seqlens"].tolist() == [0, 5, 8, 16, 32] and b["max_seqlen"] == 16
    filler = collate(s.tokens, s.mask, s.offsets, MicroBatchSpec((), 8), pad_id=2)
    assert (filler["labels"] == -100).all() and filler["input_ids"].shape == (1, 8)


@pytest.mark.parametrize("strategy", ["pack", "bucket", "pad"])
def test_loader_covers_the_epoch_and_counts_targets(store, strategy):
    loader = loader_for(store, cfg(batching=strategy))
    assert loader.total_steps == loader.steps_per_epoch
    batches = list(loader)
    metas = [b["meta"] for b in batches]
    assert sum(m.n_seen for m in metas) == store.n_tokens
    targets = int(store.target_counts().sum())
    assert sum(m.n_targets for m in metas) == targets
    assert sum(m.n_positions for m in metas) == loader.efficiency().positions
    steps = sorted({m.step for m in metas})
    assert steps == list(range(loader.steps_per_epoch))
    for step in steps:
        ms = [m for m in metas if m.step == step]
        assert [m.micro_index for m in ms] == list(range(ms[0].micro_count))
        assert ms[0].step_targets == sum(m.n_targets for m in ms)
    for b in batches:
        assert set(b) == {"input_ids", "labels", "position_ids", "cu_seqlens", "max_seqlen", "meta"}
        assert b["input_ids"].shape[0] <= 2
        assert all(isinstance(v, int) for v in dataclasses.asdict(b["meta"]).values())


def test_multiple_epochs_use_a_new_order(store):
    loader = loader_for(store, cfg(batching="bucket", epochs=2))
    assert loader.total_steps == loader.steps_in_epoch(0) + loader.steps_in_epoch(1)
    batches = list(loader)
    e0 = [b for b in batches if b["meta"].epoch == 0]
    e1 = [b for b in batches if b["meta"].epoch == 1]
    assert sum(b["meta"].n_seen for b in e1) == store.n_tokens
    assert e1[0]["meta"].step == loader.steps_in_epoch(0) and e1[0]["meta"].epoch_step == 0
    assert not torch.equal(e0[0]["input_ids"], e1[0]["input_ids"])
    half = loader_for(store, cfg(batching="pack", epochs=1.5))
    assert half.total_steps == half.steps_per_epoch + -(-half.steps_per_epoch // 2)
    fixed = loader_for(store, cfg(batching="pack", max_steps=3 * half.steps_per_epoch + 1))
    assert list(fixed)[-1]["meta"].epoch == 3


def same(a, b):
    return (
        a["meta"] == b["meta"]
        and torch.equal(a["input_ids"], b["input_ids"])
        and torch.equal(a["labels"], b["labels"])
        and torch.equal(a["position_ids"], b["position_ids"])
    )


@pytest.mark.parametrize("strategy", ["pack", "bucket"])
def test_resume_mid_run_gives_exactly_the_remaining_batches(store, strategy):
    c = cfg(batching=strategy, epochs=2, micro_batch_size=1)
    full = list(loader_for(store, c))
    first = loader_for(store, c)
    it = iter(first)
    consumed = []
    for b in it:  # stop after the last micro-batch of step 5
        consumed.append(b)
        if b["meta"].step == 5 and b["meta"].micro_index == b["meta"].micro_count - 1:
            break
    state = first.state_dict()
    assert state["global_step"] == 6
    resumed = loader_for(store, c)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(consumed) + len(rest) == len(full)
    assert all(same(a, b) for a, b in zip(full[len(consumed) :], rest))
    # Crossing the epoch boundary: state in epoch 1 resumes there.
    second = loader_for(store, c)
    second.load_state_dict({**state, "epoch": 1, "step": 2, "global_step": None})
    assert next(iter(second))["meta"].step == second.steps_in_epoch(0) + 2


def test_resume_after_a_partial_step_restarts_that_step(store):
    c = cfg(batching="bucket", micro_batch_size=1)
    loader = loader_for(store, c)
    it = iter(loader)
    b = next(it)
    assert b["meta"].micro_count > 1
    assert loader.state_dict()["step"] == 0
    resumed = loader_for(store, c)
    resumed.load_state_dict(loader.state_dict())
    assert same(next(iter(resumed)), b)


def test_resume_refuses_a_different_data_order(store):
    state = loader_for(store, cfg(batching="pack")).state_dict()
    other = loader_for(store, cfg(batching="pack", seed=1))
    with pytest.raises(LoaderError, match="seed: 0 then, 1 now"):
        other.load_state_dict(state)
    # Micro-batch size and world size never change step composition: resuming is allowed.
    loader_for(store, cfg(batching="pack", micro_batch_size=1)).load_state_dict(state)


def test_resume_of_a_plan_filled_another_way_is_refused_past_one_chunk(store, monkeypatch):
    """A checkpoint of a pitstop that filled rows over the whole epoch (no `fill_chunk`)
    resumes where the plan is one chunk (the same rows), and is refused where chunks would
    change the rows, saying so."""
    import pitstop.batching.plan as plan_mod

    old = loader_for(store, cfg(batching="pack")).state_dict()
    old.pop("fill_chunk")
    assert old["n_sequences"] == 400
    loader_for(store, cfg(batching="pack")).load_state_dict(old)  # 400 <= FILL_CHUNK
    monkeypatch.setattr(plan_mod, "FILL_CHUNK", 100)
    with pytest.raises(LoaderError, match="row fill: over the whole epoch then, in chunks of 100"):
        loader_for(store, cfg(batching="pack")).load_state_dict(old)
    state = loader_for(store, cfg(batching="pack")).state_dict()
    assert state["fill_chunk"] == 100
    loader_for(store, cfg(batching="pack")).load_state_dict(state)  # the same fill: resumes


@pytest.mark.parametrize(
    ("before", "after"), [("pack", "pad"), ("pad", "bucket"), ("bucket", "pack")]
)
def test_resume_under_another_layout_continues_the_same_documents(store, before, after):
    """docs/training.md: layout settings may change on resume (issue 33: pad was refused)."""

    def docs_per_step(loader):
        out: dict[int, list[int]] = {}
        for b in loader:
            ids = b["input_ids"][b["labels"] != -100]
            out.setdefault(b["meta"].step, []).extend(ids.tolist())
        return {k: sorted(v) for k, v in out.items()}

    first = loader_for(store, cfg(batching=before))
    it = iter(first)
    for b in it:  # stop after step 3
        if b["meta"].step == 3 and b["meta"].micro_index == b["meta"].micro_count - 1:
            break
    resumed = loader_for(store, cfg(batching=after))
    resumed.load_state_dict(first.state_dict())
    rest = docs_per_step(resumed)
    uninterrupted = docs_per_step(loader_for(store, cfg(batching=before)))
    assert min(rest) == 4 and rest == {k: v for k, v in uninterrupted.items() if k >= 4}


@pytest.mark.parametrize("strategy", ["pack", "bucket", "pad"])
def test_two_ranks_split_every_step(store, strategy):
    c = cfg(batching=strategy)
    ranks = [list(loader_for(store, c, rank=r, world_size=2)) for r in (0, 1)]
    steps = [sorted({b["meta"].step for b in bs}) for bs in ranks]
    assert steps[0] == steps[1]
    seen = sum(b["meta"].n_seen for bs in ranks for b in bs)
    assert seen == store.n_tokens
    for step in steps[0]:
        per_rank = [[b["meta"] for b in bs if b["meta"].step == step] for bs in ranks]
        total = sum(m.n_targets for ms in per_rank for m in ms)
        assert all(ms and ms[0].step_targets == total for ms in per_rank)

    # Sequences are disjoint between ranks: compare the first tokens of every row's documents.
    def docs(bs):
        out = set()
        for b in bs:
            if b["meta"].filler:
                continue
            pos, ids = b["position_ids"], b["input_ids"]
            starts = (pos == 0).nonzero().tolist()
            out |= {(ids[r, c : c + 4].tolist().__repr__()) for r, c in starts}
        return out

    assert not docs(ranks[0]) & docs(ranks[1])


def test_workers_give_the_same_batches(store):
    c0 = cfg(batching="bucket")
    ref = list(loader_for(store, c0))
    loader = loader_for(store, cfg(batching="bucket", loader_workers=1))
    got = []
    for b in loader:  # stop mid-run with batches prefetched, then iterate again
        got.append(b)
        if b["meta"].step == 2 and b["meta"].micro_index == b["meta"].micro_count - 1:
            break
    got += list(loader)  # the persistent workers continue from the loader's position
    assert len(got) == len(ref) and all(same(a, b) for a, b in zip(ref, got))
    assert loader.state_dict()["global_step"] == loader.total_steps


class _Crash:
    def __getitem__(self, key):
        os._exit(3)


def test_a_worker_crash_is_a_pitstop_error(store):
    loader = loader_for(store, cfg(batching="pack", loader_workers=1))
    loader._dataset = _Crash()
    with pytest.raises(LoaderError, match="DataLoader worker failed"):
        list(loader)


def test_store_longer_than_max_seq_len_is_refused(store):
    with pytest.raises(LoaderError, match="prepare it again"):
        loader_for(store, cfg(max_seq_len=32, tokens_per_step=128, batching="pad"))


def test_default_workers():
    assert default_loader_workers(1000, 16)[0] == 0
    assert default_loader_workers(10**9, 16)[0] == 4
    assert default_loader_workers(10**9, 2)[0] == 1
    assert default_loader_workers(10**9, 1)[0] == 0
