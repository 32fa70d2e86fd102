"""Two multi-process defects suspected in issue 26, closed on the CPU without starting a
process group: the process-group timeout and FSDP2 + LoRA on torch < 2.8."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from pitstop import probe
from pitstop.core.config import RunConfig
from pitstop.probe import DeviceInfo, preflight, strategy_problems
from pitstop.train import distributed

CPU = DeviceInfo(type="cpu", name="test cpu", cpu_count=2)
GPU = DeviceInfo(type="cuda", name="NVIDIA A100-SXM4-80GB", capability=(8, 0), bf16=True)


@pytest.fixture
def captured(monkeypatch):
    """`init_process_group`'s arguments, as rank 1 of 2 would pass them (no group is made)."""
    calls: list[tuple[tuple, dict]] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: calls.append((a, kw)))
    for k, v in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(k, v)
    return calls


def test_gloo_group_waits_an_hour_for_rank_0(captured):
    env, _ = distributed.init(CPU)
    [(args, kw)] = captured
    assert args == ("gloo",) and env.backend == "gloo" and env.world_size == 2
    # torch's default, 10 minutes, kills the waiting ranks while rank 0 saves a large model.
    assert kw["timeout"] == distributed.PROCESS_GROUP_TIMEOUT >= timedelta(minutes=60)


def test_nccl_group_gets_the_same_timeout(captured, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    _, dev = distributed.init(GPU)
    [(args, kw)] = captured
    assert args == ("nccl",) and dev.index == 1
    assert kw["timeout"] == distributed.PROCESS_GROUP_TIMEOUT
    assert kw["device_id"] == torch.device("cuda", 1)


def _cfg(tmp_path, **kw):
    base = {"strategy": "fsdp", "lora_r": 4, "precision": "bf16"}
    return RunConfig(model="m", data=["d"], output=str(tmp_path / "out"), **{**base, **kw})


@pytest.mark.parametrize("version", ["2.6.0", "2.7.1+cu126", "2.7.0a0+git1234"])
def test_fsdp_lora_refused_before_torch_2_8(tmp_path, version):
    [msg] = strategy_problems(_cfg(tmp_path), distributed=True, torch_version=version)
    assert f"found {version}" in msg and "torch>=2.8" in msg
    assert "--strategy ddp" in msg and "--precision fp32" in msg


@pytest.mark.parametrize("version", ["2.8.0", "2.8.0a0+git1", "2.10.1", "3.0.0"])
def test_fsdp_lora_allowed_from_torch_2_8(tmp_path, version):
    assert strategy_problems(_cfg(tmp_path), distributed=True, torch_version=version) == []


def test_only_the_mixed_dtype_combination_is_refused(tmp_path):
    def problems(**kw):
        return strategy_problems(_cfg(tmp_path, **kw), distributed=True, torch_version="2.7.1")

    assert problems(strategy="ddp") == []
    assert problems(lora_r=None) == []  # full fine-tune: every parameter fp32
    assert problems(precision="fp32") == []  # fp32 base and fp32 adapter: one dtype
    assert len(problems(precision="auto")) == 1  # auto is bf16 on most GPUs
    assert (
        strategy_problems(_cfg(tmp_path), distributed=False, torch_version="2.7.1") == []
    )  # one process: nothing is sharded


def test_preflight_reads_the_installed_torch(tmp_path, monkeypatch):
    monkeypatch.setattr(probe, "_torch_version", lambda: "2.7.1")
    [msg] = preflight(_cfg(tmp_path, nproc=2), GPU)
    assert "found 2.7.1" in msg
    monkeypatch.setattr(probe, "_torch_version", lambda: "2.8.0")
    assert preflight(_cfg(tmp_path, nproc=2), GPU) == []
    # The real lookup agrees with the imported torch (no import needed to read it).
    monkeypatch.undo()
    assert probe._torch_version().split("+")[0] == torch.__version__.split("+")[0]
