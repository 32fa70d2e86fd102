"""The run's peak memory starts after the micro-batch sizer's trials, not before them.

On CUDA the sizer (train/memory_plan.py `cuda_sizer`) runs forward+backward passes of micro-batches
as large as the device holds, and `batching: auto` times each layout; the run's
`peak_memory_bytes` is `torch.cuda.max_memory_allocated()` (measure/memory.py), which
would otherwise report the largest trial. Here (CPU) the order of the calls is checked:
every trial pass, then the reset, once; and `cuda_sizer`'s reset is CUDA's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_tokenizer):
    from _train_util import make_store

    return make_store(tmp_path_factory.mktemp("peakwin") / "store", tiny_tokenizer, n_docs=40)


def _build(cfg, sizer, run_micro_batch=None):
    from pitstop.batching.resolve import BatchRequest
    from pitstop.data.store import TokenStore
    from pitstop.train import data as data_mod

    return data_mod.build_loader(
        BatchRequest(
            cfg, TokenStore(cfg.data[0]), run_micro_batch=run_micro_batch,
            device_name="FakeGpu 80GB", out=Path(cfg.output), cache_dir=cfg.cache_dir,
            sizer=sizer,
        )
    )  # fmt: skip


def _recording_sizer(calls: list[str]):
    from pitstop.batching.resolve import MicroSizer

    def measure(batch) -> tuple[float, float]:
        rows = int(batch["input_ids"].shape[0])
        calls.append(f"size {rows}")
        return rows * 1e9, 0.01 * rows  # 1 GB a row, 10 ms a row

    return MicroSizer(
        measure, 40e9, 0.0, start_peak_window=lambda: calls.append("reset peak")
    )  # fmt: skip


def test_the_peak_window_starts_after_the_sizers_trials(tiny_model_dir, store, tmp_path):
    from _train_util import train_config

    calls: list[str] = []
    cfg = train_config(tiny_model_dir, store, tmp_path / "out", micro_batch_size=None,
                       tokens_per_step=16 * 64)  # fmt: skip
    _, geo = _build(cfg, _recording_sizer(calls))
    assert geo.choices["micro_batch"].value.endswith("rows")  # it was sized
    assert len(calls) >= 3 and all(c.startswith("size ") for c in calls[:-1])
    assert calls[-1] == "reset peak" and calls.count("reset peak") == 1


def test_the_peak_window_starts_after_autos_timing_too(tiny_model_dir, store, tmp_path):
    from _train_util import train_config

    calls: list[str] = []

    def timed(batch) -> float:  # `batching: auto`'s timed forward+backward
        calls.append("auto")
        return 1.0

    cfg = train_config(tiny_model_dir, store, tmp_path / "out", micro_batch_size=None,
                       tokens_per_step=16 * 64, batching="auto")  # fmt: skip
    _build(cfg, _recording_sizer(calls), run_micro_batch=timed)
    assert "auto" in calls and any(c.startswith("size ") for c in calls)
    assert calls[-1] == "reset peak" and calls.count("reset peak") == 1


def test_cuda_sizer_resets_cudas_peak_statistics_of_its_device(monkeypatch):
    from pitstop.probe import Choice
    from pitstop.train.memory_plan import cuda_sizer

    resets: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70e9, 80e9))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(
        torch.cuda, "reset_peak_memory_stats", lambda device=None: resets.append(device)
    )
    device = torch.device("cuda", 1)
    sizer = cuda_sizer(torch.nn.Linear(4, 4), device, "sdpa", None, Choice("adamw", "test"))
    assert resets == []  # building the sizer starts nothing
    sizer.start_peak_window()
    assert resets == [device]
