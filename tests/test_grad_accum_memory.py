"""Gradient memory while micro-batches accumulate, with 2 processes on CPU (gloo).

DDP: `.grad` must stay a view into DDP's all-reduce bucket through the no_sync
micro-batches (zeroed in place between steps), or each rank holds a second gradient copy
the micro-batch sizer does not reserve. FSDP2: every micro-batch reduce-scatters, so a
rank holds only its shard of the gradients, never the whole model's unsharded ones.
Neither may change the training math: the same loss, gradients and parameters as one
process over the same rows. The ranks run tests/_grad_accum_worker.py under torchrun.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _train_util import free_port

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("_grad_accum_worker.py")
TOL = 1e-6  # fp32: the ranks sum in another order than one process


def _ranks(strategy: str, out: Path) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), str(WORKER), strategy, str(out)]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]


def _same_math(res: dict) -> None:
    for i, st in enumerate(res["steps"]):
        assert st["loss_diff"] < TOL, (i, st)
        assert st["grad_max_diff"] < TOL, (i, st)
        assert st["param_max_diff"] < TOL, (i, st)


@pytest.mark.slow
@pytest.mark.long
def test_ddp_no_sync_micro_batches_accumulate_into_the_buckets(tmp_path):
    for res in _ranks("ddp", tmp_path):
        for i, st in enumerate(res["steps"]):
            # Every micro-batch's gradients lie in the storage the synced backward
            # all-reduced: the first step too (wrap makes them bucket views at once).
            assert st["micro_batches_in_bucket"] == [True, True], (i, st)
            assert st["bytes_beside_buckets"] == [0, 0], (i, st)  # before: [26180, 0]
            # After the optimizer step: zeros, still in the bucket (not None).
            assert all(st["zeroed_grads_in_bucket"]) and st["grads_zero_after_step"], (i, st)
        _same_math(res)


@pytest.mark.slow
@pytest.mark.long
def test_fsdp2_holds_only_sharded_gradients_between_micro_batches(tmp_path):
    for res in _ranks("fsdp", tmp_path):
        sharded, full = res["sharded_grad_bytes"], res["full_grad_bytes"]
        assert sharded < full  # two ranks: each holds about half
        for i, st in enumerate(res["steps"]):
            # Before the fix: the full model's unsharded gradients (26,180 bytes here).
            assert st["held_grad_bytes_not_last"] == [sharded], (i, st, full)
        _same_math(res)


@pytest.fixture()
def gloo_world_of_one(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_trainer_step_zeroes_ddp_gradients_in_their_buckets(gloo_world_of_one):
    """The trainer's optimizer step (not only the helper) keeps DDP's bucket views."""
    from pitstop.core.config import RunConfig
    from pitstop.train import distributed
    from pitstop.train.trainer import Trainer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    cfg = RunConfig(model="m", data="d", output="o", strategy="ddp", max_grad_norm=1.0)
    ddp, _ = distributed.wrap(model, cfg, distributed.DistEnv(0, 2, 0, "gloo"))
    params = list(model.parameters())
    before = [p.grad.untyped_storage().data_ptr() for p in params]  # bucket views from wrap
    ddp(torch.randn(4, 8)).sum().backward()
    assert [p.grad.untyped_storage().data_ptr() for p in params] == before
    tr = Trainer.__new__(Trainer)
    tr.__dict__.update(
        run=SimpleNamespace(
            cfg=cfg, wrapped=ddp, params=params, scaler=None, sync_free_skip=False,
            optimizer=torch.optim.AdamW(params, lr=1e-2), warmup=0,
            env=distributed.DistEnv(0, 2, 0, "gloo"), device=torch.device("cpu"),
        ),
        state=SimpleNamespace(step=0), cadence=SimpleNamespace(last_step=10), _ckpt_copy=None,
    )  # fmt: skip
    tr.optimizer_step(torch.tensor(1.0))
    assert [p.grad.untyped_storage().data_ptr() for p in params] == before
    assert all(not p.grad.any() for p in params)


def test_zero_grad_frees_gradients_without_ddp():
    from pitstop.train import distributed

    model = torch.nn.Linear(4, 1)
    model(torch.randn(2, 4)).sum().backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    distributed.zero_grad(opt, model)  # one process or FSDP2: set to None, memory freed
    assert all(p.grad is None for p in model.parameters())
