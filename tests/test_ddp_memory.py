"""DDP's gradient buckets in the micro-batch sizer's arithmetic (issue 26 item 6).

DDP copies every gradient into its all-reduce buckets unless gradient_as_bucket_view is
set. pitstop sets it (no second copy); the sizer reserves a copy exactly when it is off.
"""

from __future__ import annotations

import pytest
import torch

from pitstop.probe import Choice
from pitstop.train import distributed as dist_mod
from pitstop.train.memory_plan import sizer_reserved_bytes

ADAMW = Choice("adamw_fused", "test")


def _params_3b() -> list[torch.nn.Parameter]:
    """A 3B-parameter fp32 full fine-tune, without allocating it (meta tensors)."""
    return [torch.nn.Parameter(torch.empty(3_000_000_000, device="meta"))]


def test_reserved_bytes_count_ddp_buckets_only_without_bucket_views() -> None:
    params = _params_3b()
    moments = 2 * 12_000_000_000  # AdamW: two fp32 moments
    assert sizer_reserved_bytes(params, ADAMW, ddp=False) == moments
    assert sizer_reserved_bytes(params, ADAMW, ddp=True, bucket_view=True) == moments
    # The copy issue 26 found missing: 12 GB, more than an 80 GB card's 8 GB headroom.
    assert sizer_reserved_bytes(params, ADAMW, ddp=True, bucket_view=False) == moments + 12e9
    # What the run sets is what the sizer assumes.
    assert dist_mod.GRADIENT_AS_BUCKET_VIEW is True
    assert sizer_reserved_bytes(params, ADAMW, ddp=True) == moments


def test_frozen_parameters_have_no_bucket_copy() -> None:
    frozen = torch.nn.Parameter(torch.empty(1000, device="meta"), requires_grad=False)
    assert dist_mod.ddp_gradient_copy_bytes([frozen], bucket_view=False) == 0


@pytest.fixture()
def gloo_world_of_one(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_ddp_wrap_sets_bucket_views_and_set_to_none_keeps_working(gloo_world_of_one) -> None:
    from pitstop.core.config import RunConfig

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    cfg = RunConfig(model="m", data="d", output="o", strategy="ddp")
    env = dist_mod.DistEnv(0, 2, 0, "gloo")  # a 2-rank run, as far as wrap can tell
    ddp, choice = dist_mod.wrap(model, cfg, env)
    assert ddp.gradient_as_bucket_view is True and "no second copy" in choice.reason
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(4, 8)
    grads = []
    for _ in range(2):  # zero_grad(set_to_none=True) between steps, as the trainer does
        ddp(x).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert all(g is not None for g in grads[1])
    # The same gradients as the bare model's (world of one: nothing averaged away).
    ref = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    ref.load_state_dict(model.state_dict())
    ddp(x).sum().backward()
    ref(x).sum().backward()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
