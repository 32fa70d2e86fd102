"""The micro-batch sized to the device (issue 17), on CPU with a fake memory and time model.

The rule lives in pitstop.batching.microsize; the GPU measurement (peak memory and time of
real steps) is injected. These tests check the pick, the headroom, the extrapolation, the
confirmation step-down, the speed rule, the cache reuse, and that the split never changes
which documents form an optimizer step.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from pitstop.batching.microsize import choose_micro_rows, packed_sample, row_candidates

GB = 1e9


class FakeGpu:
    """Peak memory = weights + per-row activations (+ an optional extra from `over` rows on);
    time = launch overhead + per-row work, so bigger micro-batches are faster per token."""

    def __init__(self, *, base=4 * GB, per_row=2 * GB, over=None, slow_from=None):
        self.base, self.per_row = base, per_row
        self.over = over or {}
        self.slow_from = slow_from
        self.calls: list[int] = []

    def peak(self, rows: int) -> float:
        return self.base + self.per_row * rows + self.over.get(rows, 0.0)

    def __call__(self, rows: int) -> tuple[float, float]:
        self.calls.append(rows)
        sec = 0.05 + 0.01 * rows
        if self.slow_from is not None and rows >= self.slow_from:
            sec *= 3  # e.g. a dense B x T x T document mask past some size
        return self.peak(rows), sec


def test_candidates_split_a_step_evenly():
    assert row_candidates(64) == [1, 2, 4, 8, 16, 32, 64]
    assert row_candidates(12) == [1, 2, 3, 4, 6, 12]
    assert row_candidates(7) == [1, 7]


def test_picks_the_largest_size_that_fits_in_the_budget():
    gpu = FakeGpu()
    # 80 GB, 10% headroom, 8 GB optimizer state: budget 64 GB; 16 rows need 36 GB, 32 need 68.
    pick = choose_micro_rows(gpu, max_rows=64, row_tokens=1024, capacity_bytes=80 * GB,
                             reserved_bytes=8 * GB)  # fmt: skip
    assert pick.rows == 16
    assert pick.budget_bytes == pytest.approx(80 * GB * 0.9 - 8 * GB)
    assert gpu.calls[:2] == [2, 4]  # two small sizes, then the pick to confirm it
    assert 16 in gpu.calls and 32 not in gpu.calls and 64 not in gpu.calls
    assert "16: " in pick.reason and "tokens per optimizer step unchanged" in pick.reason


def test_memory_is_extrapolated_linearly_in_rows():
    gpu = FakeGpu(base=3 * GB, per_row=1.5 * GB)
    pick = choose_micro_rows(gpu, max_rows=64, row_tokens=512, capacity_bytes=200 * GB)
    for rows, predicted in pick.predicted_bytes.items():
        assert predicted == pytest.approx(gpu.peak(rows))


def test_headroom_keeps_a_size_that_would_only_just_fit():
    gpu = FakeGpu()
    # 16 rows need 36 GB: fits 38 GB with no headroom, not with 10% (34.2 GB)
    assert choose_micro_rows(gpu, max_rows=64, row_tokens=1, capacity_bytes=38 * GB,
                             headroom=0.0).rows == 16  # fmt: skip
    assert choose_micro_rows(gpu, max_rows=64, row_tokens=1, capacity_bytes=38 * GB).rows == 8


def test_a_pick_that_does_not_fit_when_measured_steps_down():
    # Linear from 2 and 4 rows predicts 32 rows fits; measured, it does not (something
    # grows faster than linearly), so the next smaller size is measured and taken.
    gpu = FakeGpu(over={32: 40 * GB})
    pick = choose_micro_rows(gpu, max_rows=64, row_tokens=1, capacity_bytes=100 * GB)
    assert pick.rows == 16
    assert 32 in gpu.calls and 16 in gpu.calls
    assert "(over budget)" in pick.reason


def test_a_larger_size_that_is_not_faster_loses():
    gpu = FakeGpu(slow_from=16)  # 16 rows fit but run slower per token than 8
    pick = choose_micro_rows(gpu, max_rows=64, row_tokens=1, capacity_bytes=80 * GB)
    assert pick.rows == 8
    assert 16 in gpu.calls and 8 in gpu.calls
    assert pick.reason.startswith("fastest of those that fit")


def test_out_of_memory_at_the_start_goes_down_to_one_row():
    def oom_above_one(rows: int) -> tuple[float, float]:
        return (2 * GB, 0.1) if rows == 1 else (math.inf, math.inf)

    pick = choose_micro_rows(oom_above_one, max_rows=8, row_tokens=1, capacity_bytes=10 * GB)
    assert pick.rows == 1
    assert "2: out of memory" in pick.reason


def test_nothing_fits_says_so():
    pick = choose_micro_rows(lambda r: (math.inf, math.inf), max_rows=8, row_tokens=64,
                             capacity_bytes=10 * GB)  # fmt: skip
    assert (
        pick.rows == 1
        and "did not fit" in pick.reason
        and "--gradient-checkpointing" in pick.reason
    )


# --- wired into the loader: cache, resume, and the step's documents ------------------


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_tokenizer):
    from _train_util import make_store

    return make_store(tmp_path_factory.mktemp("microsize") / "store", tiny_tokenizer, n_docs=120)


def _cfg(model: Path, store: Path, out: Path, **over):
    from _train_util import train_config

    return train_config(
        model, store, out, **{"micro_batch_size": None, "tokens_per_step": 16 * 64, **over}
    )


def _build(cfg, sizer):
    from pitstop.batching.resolve import BatchRequest
    from pitstop.data.store import TokenStore
    from pitstop.train import data as data_mod

    return data_mod.build_loader(
        BatchRequest(
            cfg, TokenStore(cfg.data[0]), device_name="FakeGpu 80GB", out=Path(cfg.output),
            cache_dir=cfg.cache_dir, sizer=sizer,
        )
    )  # fmt: skip


def _sizer(calls: list[int], capacity: float = 23 * GB):
    from pitstop.batching.resolve import MicroSizer

    gpu = FakeGpu()

    def measure(batch) -> tuple[float, float]:
        rows, width = batch["input_ids"].shape
        assert width == 64 and int((batch["labels"] != -100).sum()) > 0  # real packed rows
        calls.append(rows)
        return gpu(rows)

    return MicroSizer(measure, capacity, 0.0)


def test_sized_split_keeps_every_step_and_is_reused_from_the_cache(tiny_model_dir, store, tmp_path):
    calls: list[int] = []
    cfg = _cfg(tiny_model_dir, store, tmp_path / "out")
    default, _ = _build(cfg, None)
    loader, geo = _build(cfg, _sizer(calls))
    # budget 20.7 GB: 8 rows need 20 GB, 16 would need 36
    assert loader.settings.tokens_per_micro_batch == 8 * 64
    assert geo.choices["micro_batch"].value == "8 rows"
    assert geo.choices["micro_batch"].reason.startswith("measured")
    assert geo.measured.values["micro_batch_rows"] == 8
    assert loader.settings.tokens_per_step == default.settings.tokens_per_step
    for step in range(default.steps_per_epoch):
        a, b = default.micro_batches(step), loader.micro_batches(step)
        assert [s for m in a for s in np.concatenate(m.rows)] == [
            s for m in b for s in np.concatenate(m.rows)
        ]  # the same documents, in the same order: only the split differs
        assert all(len(m.rows) <= 8 for m in b) and len(b) <= len(a)
    assert len(loader.micro_batches(0)) == 2 and len(default.micro_batches(0)) == 8
    n = len(calls)
    _, again = _build(cfg, _sizer(calls))
    assert len(calls) == n  # reused, not measured again
    assert again.choices["micro_batch"].reason.startswith("reused")
    _, fresh = _build(_cfg(tiny_model_dir, store, tmp_path / "out", remeasure=True), _sizer(calls))
    assert len(calls) > n and fresh.choices["micro_batch"].reason.startswith("measured")


def test_sizing_is_spent_only_where_the_planned_run_repays_it(tiny_model_dir, store, tmp_path):
    """A short run takes the memory cost model's split unmeasured (and says why, with the
    numbers; not cached); a long run of the same configuration measures."""
    import dataclasses

    from pitstop.batching.resolve import BatchRequest
    from pitstop.data.store import TokenStore
    from pitstop.train import data as data_mod

    def build(cfg, sizer):
        req = BatchRequest(
            cfg, TokenStore(cfg.data[0]), device_name="FakeGpu 80GB", out=Path(cfg.output),
            cache_dir=cfg.cache_dir, sizer=sizer, seconds_per_position=1e-9,
        )  # fmt: skip
        return data_mod.build_loader(req)

    calls: list[int] = []
    measured = _sizer(calls)
    sizer = dataclasses.replace(measured, predict=FakeGpu().peak)  # the same memory, modelled
    short = _cfg(tiny_model_dir, store, tmp_path / "out")  # 6 steps
    loader, geo = build(short, sizer)
    assert calls == []
    assert loader.settings.tokens_per_micro_batch == 8 * 64  # the model's largest fit
    why = geo.choices["micro_batch"].reason
    assert why.startswith("not measured: sizing it would take ~") and "largest that fits" in why
    _, again = build(short, sizer)  # nothing was cached: decided the same way again
    assert calls == [] and again.choices["micro_batch"].reason.startswith("not measured")
    long = _cfg(tiny_model_dir, store, tmp_path / "long", max_steps=100_000)
    _, lgeo = build(long, sizer)
    assert calls and lgeo.choices["micro_batch"].reason.startswith("measured")


def test_resume_keeps_the_runs_split_without_measuring(tiny_model_dir, store, tmp_path):
    from pitstop.batching.choices import write_run_choices

    calls: list[int] = []
    out = tmp_path / "out"
    _, geo = _build(_cfg(tiny_model_dir, store, out), _sizer(calls))
    out.mkdir()
    write_run_choices(out, geo.measured)  # as the trainer does before step 1
    n = len(calls)
    # A different device memory now would pick another size: the resumed run keeps 8.
    loader, rgeo = _build(_cfg(tiny_model_dir, store, out, resume=True),
                          _sizer(calls, capacity=200 * GB))  # fmt: skip
    assert len(calls) == n
    assert loader.settings.tokens_per_micro_batch == 8 * 64
    assert rgeo.choices["micro_batch"].reason.startswith("kept from this run")


def test_a_set_micro_batch_is_never_sized(tiny_model_dir, store, tmp_path):
    calls: list[int] = []
    cfg = _cfg(tiny_model_dir, store, tmp_path / "out", micro_batch_size=4)
    loader, geo = _build(cfg, _sizer(calls))
    assert calls == [] and loader.settings.micro_batch_size == 4
    assert "micro_batch" not in geo.choices


def test_packed_sample_is_full_rows_of_real_data(store):
    from pitstop.batching.loader import sequence_targets
    from pitstop.data.store import TokenStore

    s = TokenStore(store)
    batch = packed_sample(s, rows=3, max_seq_len=64, tokens_per_step=64 * 16, seed=0,
                          trained=sequence_targets(s))  # fmt: skip
    assert tuple(batch["input_ids"].shape) == (3, 64)
    assert (batch["position_ids"] == 0).sum() >= 3  # every row starts a document


# --- on a GPU -----------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_cuda_run_sizes_its_micro_batch_and_keeps_the_losses(tiny_model_dir, store, tmp_path):
    """A real sizing on the GPU: a size is measured and used, and the step losses match a run
    split in 2-row micro-batches (fp32, so only summation order differs)."""
    import json

    from pitstop.train import run

    common = {"device": "cuda", "precision": "fp32", "max_steps": 3, "log_steps": 1}
    sized = run(_cfg(tiny_model_dir, store, tmp_path / "a", **common))
    fixed = run(_cfg(tiny_model_dir, store, tmp_path / "b", micro_batch_size=2, **common))
    rows = sized["measured_choices"]["values"]["micro_batch_rows"]
    assert 1 <= rows <= 16 and sized["choices"]["micro_batch"]["value"] == f"{rows} rows"
    la = [
        json.loads(x)["loss"] for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
    ]
    lb = [
        json.loads(x)["loss"] for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
    ]
    assert la == pytest.approx(lb, rel=1e-4)
    assert sized["trained_tokens"] == fixed["trained_tokens"]


# --- a CUDA out-of-memory in the run: half the micro-batch, same step -------------------


def _losses(out: Path) -> list[float]:
    import json

    return [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_an_oom_backs_off_to_half_the_micro_batch_and_keeps_the_run(
    tiny_model_dir, store, tmp_path, monkeypatch
):
    """Step 2's 4-row micro-batches 'run out of CUDA memory' (injected; the loop cannot tell):
    the run redoes step 2 in 2-row micro-batches and ends like a run that never did."""
    from pitstop.train import run

    common = {"micro_batch_size": 4, "max_steps": 4, "log_steps": 1, "tokens_per_step": 8 * 64}
    plain = run(_cfg(tiny_model_dir, store, tmp_path / "plain", **common))
    monkeypatch.setenv("PITSTOP_TEST_OOM_ROWS", "2:2")
    backed = run(_cfg(tiny_model_dir, store, tmp_path / "oom", **common))
    assert backed["status"] == "completed" and backed["optimizer_steps"] == 4
    assert backed["trained_tokens"] == plain["trained_tokens"]
    assert _losses(tmp_path / "oom") == pytest.approx(_losses(tmp_path / "plain"), rel=1e-5)
    mb = backed["choices"]["micro_batch"]
    assert mb["value"] == "2 rows" and "out-of-memory in step 2" in mb["reason"]


def test_an_oom_at_one_row_still_stops_with_the_message(
    tiny_model_dir, store, tmp_path, monkeypatch
):
    from pitstop.train import run
    from pitstop.train.oom import TrainingOutOfMemory

    monkeypatch.setenv("PITSTOP_TEST_OOM_ROWS", "1:0")
    with pytest.raises(TrainingOutOfMemory):
        run(_cfg(tiny_model_dir, store, tmp_path / "o", micro_batch_size=1, max_steps=2))
