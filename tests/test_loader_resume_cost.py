"""A resume in a later epoch plans that epoch only (issue 32): the loader's state carries
the steps of the epochs before it, so resuming at epoch e costs what starting costs, and
a state without them (an older checkpoint) still resumes to the same batch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_batching_support import long_tailed_lengths, make_store

from pitstop.batching import loader as loader_mod
from pitstop.batching.loader import LoaderOptions, MicroBatchLoader
from pitstop.batching.settings import BatchSettings

MSL = 64


@pytest.fixture
def store(tmp_path: Path):
    return make_store(tmp_path / "s", long_tailed_lengths(600, MSL), max_seq_len=MSL)


def _loader(store) -> MicroBatchLoader:
    settings = BatchSettings("pack", MSL, 8 * MSL, micro_batch_size=2)
    return MicroBatchLoader(store, settings, LoaderOptions(seed=1, epochs=3, workers=0))


def _count_plans(monkeypatch) -> list[int]:
    """The epochs the loader plans from now on, in order."""
    planned: list[int] = []
    real = loader_mod.build_plan

    def counting(*args, **kw):
        planned.append(kw["epoch"])
        return real(*args, **kw)

    monkeypatch.setattr(loader_mod, "build_plan", counting)
    return planned


def test_resume_in_a_later_epoch_plans_that_epoch_only(store, monkeypatch) -> None:
    a = _loader(store)
    a._next_step = a.steps_in_epoch(0) + a.steps_in_epoch(1) + 2  # epoch 2, step 2
    state = a.state_dict()
    assert state["epoch"] == 2 and state["epoch_steps"] == [a.steps_in_epoch(e) for e in (0, 1)]
    want = next(iter(a))

    planned = _count_plans(monkeypatch)
    b = _loader(store)
    b.load_state_dict(state)
    got = next(iter(b))
    assert planned == [2]
    assert got["meta"].step == want["meta"].step
    assert np.array_equal(got["input_ids"], want["input_ids"])

    # an older checkpoint's state, without the counts: planned again, same batch
    planned.clear()
    c = _loader(store)
    c.load_state_dict({k: v for k, v in state.items() if k != "epoch_steps"})
    assert np.array_equal(next(iter(c))["input_ids"], want["input_ids"])
    assert planned[:2] == [0, 1]


@pytest.mark.parametrize("bad", [[1], [0, 5], ["3", 4], [True, 4], "12"])
def test_malformed_epoch_steps_are_ignored(store, bad) -> None:
    a = _loader(store)
    a._next_step = a.steps_in_epoch(0) + a.steps_in_epoch(1)
    state = {**a.state_dict(), "epoch_steps": bad}
    b = _loader(store)
    b.load_state_dict(state)
    assert b._next_step == a._next_step  # counted from the plans, not the damaged list


def test_a_run_of_three_epochs_plans_each_once_before_its_first_step(store, monkeypatch) -> None:
    """The schedule's total counts the later epochs' steps at start; their plans are not
    kept, so epoch 0's stays planned for the first step (it was evicted and built again)."""
    planned = _count_plans(monkeypatch)
    a = _loader(store)
    total = a.total_steps
    first = next(iter(a))
    assert planned == [0, 1, 2] and first["meta"].step == 0
    assert total == sum(a.steps_in_epoch(e) for e in range(3)) and planned == [0, 1, 2]
    steps = [b["meta"].step for b in a]  # the rest of the run: each later epoch planned again
    assert planned == [0, 1, 2, 1, 2] and steps[-1] == total - 1
