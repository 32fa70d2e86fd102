"""The epoch plan and its micro-batches: coverage, determinism, step stability, budgets, ranks."""

from __future__ import annotations

import numpy as np
import pytest
from test_batching_support import long_tailed_lengths

from pitstop.batching.plan import (
    STEP_BAND,
    build_plan,
    measure_efficiency,
    plan_efficiency,
    step_micro_batches,
)
from pitstop.batching.settings import BatchSettings
from pitstop.core.config import RunConfig
from pitstop.core.errors import ConfigError

MSL = 128
TPS = 8 * MSL
LENGTHS = long_tailed_lengths(3000, MSL, seed=1)
STRATS = ["pack", "bucket", "pad"]


def plan_of(strategy, epoch=0, seed=0, lengths=LENGTHS, tps=TPS):
    return build_plan(
        lengths, strategy=strategy, max_seq_len=MSL, tokens_per_step=tps, seed=seed, epoch=epoch
    )


def step_seqs(plan, step):
    return sorted(np.concatenate(plan.step_rows(step)).tolist())


@pytest.mark.parametrize("strategy", STRATS)
def test_every_sequence_exactly_once_per_epoch(strategy):
    for epoch in (0, 1):
        p = plan_of(strategy, epoch)
        assert np.array_equal(np.sort(p.seqs), np.arange(len(LENGTHS)))
        assert (p.row_tokens <= MSL).all()
        real = np.diff(np.r_[0, np.cumsum(p.row_tokens)][p.step_bounds])
        # Every step but the last within the budget ± half a row (the plan's STEP_BAND).
        assert (np.abs(real[:-1] - TPS) <= STEP_BAND * MSL).all()
        assert 0 < real[-1] <= TPS + STEP_BAND * MSL
        assert np.mean(real) > 0.9 * TPS
        if strategy != "pack":
            assert (np.diff(p.row_bounds) == 1).all()  # one sequence per row


@pytest.mark.parametrize("strategy", STRATS)
def test_plan_is_deterministic_and_changes_with_epoch_and_seed(strategy):
    a, b = plan_of(strategy, 3), plan_of(strategy, 3)
    assert np.array_equal(a.seqs, b.seqs) and np.array_equal(a.step_bounds, b.step_bounds)
    for other in (plan_of(strategy, 4), plan_of(strategy, 3, seed=1)):
        assert not np.array_equal(a.seqs, other.seqs)


@pytest.mark.parametrize("epoch", [0, 3])
def test_every_layout_trains_the_same_sequences_in_each_step(epoch):
    # The step plan comes first: layouts only arrange a step's sequences into rows.
    plans = {k: plan_of(k, epoch) for k in STRATS}
    ref = plans["pad"]
    for strategy, p in plans.items():
        assert p.n_steps == ref.n_steps, strategy
        for step in range(p.n_steps):
            assert step_seqs(p, step) == step_seqs(ref, step), (strategy, step)


def test_the_budget_counts_trained_tokens():
    # Prompt-masked sequences: half their tokens train. The budget is on trained tokens.
    trained = LENGTHS // 2
    p = build_plan(
        LENGTHS, strategy="pack", max_seq_len=MSL, tokens_per_step=TPS, seed=0, epoch=0,
        trained=trained,
    )  # fmt: skip
    per_step = p.per_step_sums(trained)
    assert (np.abs(per_step[:-1] - TPS) <= STEP_BAND * MSL).all()
    assert np.mean(per_step) > 0.9 * TPS
    assert p.n_steps < plan_of("pack").n_steps * 0.6  # about twice the tokens per step


def test_bucket_micro_batches_hold_similar_lengths():
    p = plan_of("bucket")
    s = BatchSettings("bucket", MSL, TPS, micro_batch_size=2)
    pad = plan_efficiency(plan_of("pad"), BatchSettings("pad", MSL, TPS, micro_batch_size=2))
    assert plan_efficiency(p, s).positions < pad.positions
    for step in range(p.n_steps):
        lens = [int(p.row_tokens[r]) for r in range(p.step_bounds[step], p.step_bounds[step + 1])]
        assert lens == sorted(lens, reverse=True)


MICRO_SETTINGS = [
    {"micro_batch_size": 1},
    {"micro_batch_size": 3},
    {"tokens_per_micro_batch": MSL},
    {"tokens_per_micro_batch": 5 * MSL},
]


@pytest.mark.parametrize("strategy", STRATS)
def test_step_composition_does_not_depend_on_micro_batching(strategy):
    # The plan takes no micro setting at all; this checks the split never moves a sequence.
    p = plan_of(strategy)
    for micro in MICRO_SETTINGS:
        s = BatchSettings(strategy, MSL, TPS, **micro)
        for step in range(p.n_steps):
            specs = step_micro_batches(p, step, s)
            got = sorted(np.concatenate([r for m in specs for r in m.rows]).tolist())
            assert got == step_seqs(p, step)


@pytest.mark.parametrize("strategy", STRATS)
@pytest.mark.parametrize("budget", [MSL, 3 * MSL, 8 * MSL])
def test_token_budget_micro_batches_respect_the_budget(strategy, budget):
    p = plan_of(strategy)
    s = BatchSettings(strategy, MSL, TPS, tokens_per_micro_batch=budget)
    for step in range(p.n_steps):
        for m in step_micro_batches(p, step, s):
            assert m.n_positions <= budget
            longest = max(LENGTHS[r].sum() for r in m.rows)
            assert m.width == (MSL if strategy in ("pack", "pad") else longest)


@pytest.mark.parametrize("strategy", STRATS)
def test_ranks_get_disjoint_shards_covering_the_epoch(strategy):
    p = plan_of(strategy)
    s = BatchSettings(strategy, MSL, TPS, micro_batch_size=2, world_size=2)
    seen = {0: [], 1: []}
    for step in range(p.n_steps):  # same steps for both ranks, by construction of the plan
        for rank in (0, 1):
            specs = step_micro_batches(p, step, s, rank)
            assert len(specs) >= 1
            seen[rank] += [int(i) for m in specs for r in m.rows for i in r]
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(len(LENGTHS)))
    assert abs(len(seen[0]) - len(seen[1])) < 0.1 * len(LENGTHS)


def test_a_rank_without_rows_gets_a_filler_micro_batch():
    lengths = np.array([MSL] * 3)  # pack: 3 full rows; 2 rows per step -> last step has 1 row
    p = plan_of("pack", lengths=lengths, tps=2 * MSL)
    s = BatchSettings("pack", MSL, 2 * MSL, micro_batch_size=1, world_size=2)
    last = p.n_steps - 1
    assert len(step_micro_batches(p, last, s, 0)[0].rows) == 1
    (filler,) = step_micro_batches(p, last, s, 1)
    assert filler.filler and filler.width == MSL and filler.n_positions == MSL


def test_efficiency_numbers():
    lengths = np.array([MSL // 2] * 8 + [MSL] * 2)
    pad = measure_efficiency(lengths, BatchSettings("pad", MSL, 4 * MSL, micro_batch_size=1))
    assert pad.seen_tokens == lengths.sum() and pad.positions == 10 * MSL
    assert pad.packing_efficiency == pytest.approx(6 / 10)
    assert pad.padding_waste == pytest.approx(0.4)
    pack = measure_efficiency(lengths, BatchSettings("pack", MSL, 4 * MSL, micro_batch_size=1))
    assert pack.steps == pad.steps == 2 and pack.seen_tokens == pad.seen_tokens
    assert pack.positions < pad.positions and pack.packing_efficiency >= 0.75
    p = plan_of("bucket", lengths=lengths, tps=4 * MSL)
    b = plan_efficiency(p, BatchSettings("bucket", MSL, 4 * MSL, micro_batch_size=8))
    assert 0.6 < b.packing_efficiency <= 1.0


def test_settings_from_config_and_their_errors():
    s = BatchSettings.from_config(
        RunConfig(max_seq_len=256, micro_batch_size=4, grad_accum=2), world_size=2, strategy="pad"
    )
    assert s.tokens_per_step == 4 * 2 * 256 * 2 and s.micro_batch_size == 4
    d = BatchSettings.from_config(RunConfig(max_seq_len=256, batching="bucket"))
    assert d.tokens_per_step == 8 * 256 and d.tokens_per_micro_batch == 2 * 256
    with pytest.raises(ConfigError, match="multiple of max_seq_len"):
        BatchSettings.from_config(RunConfig(max_seq_len=256, tokens_per_step=1000, batching="pack"))
    with pytest.raises(ConfigError, match="leave a rank idle"):
        BatchSettings("pack", 256, 512, micro_batch_size=1, world_size=4)
    with pytest.raises(ValueError, match="resolved first"):
        BatchSettings.from_config(RunConfig())


@pytest.mark.parametrize("strategy", ["pack", "pad"])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("lockstep", [False, True])
@pytest.mark.parametrize(
    "split", [{"micro_batch_size": 1}, {"micro_batch_size": 3}, {"tokens_per_micro_batch": 5 * MSL},
              {"tokens_per_micro_batch": MSL + 1}],
)  # fmt: skip
def test_fixed_width_efficiency_counts_equal_walking_every_micro_batch(
    strategy, world, lockstep, split
):
    """Issue 32: pack's and pad's efficiency is counted in numpy over the steps (3 s of
    start-up at a million documents in Python); it must equal the loader's micro-batches."""
    from pitstop.batching.plan import _counted, _fixed_width_counts

    # the second: a last step with fewer rows than ranks (filler micro-batches)
    for lengths, tps in ((LENGTHS, TPS), (np.array([MSL] * 9 + [5] * 3), 4 * MSL)):
        p = plan_of(strategy, lengths=lengths, tps=tps)
        s = BatchSettings(strategy, MSL, tps, world_size=world, **split)
        assert _fixed_width_counts(p, s, lockstep) == _counted(p, s, lockstep)
