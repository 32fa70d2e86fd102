"""The optimizer pitstop builds: fused AdamW on the CPU too, with the same updates as torch's
reference AdamW (one tensor at a time, neither foreach nor fused), so choosing the faster
kernel leaves the training math as it was."""

from __future__ import annotations

import torch

from pitstop.probe import DeviceInfo, choose_optimizer
from pitstop.train.optim import build_optimizer, param_groups

CPU = DeviceInfo(type="cpu", name="test cpu", cpu_count=2)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 5)
    )


def test_a_cpu_run_gets_fused_adamw_with_the_reference_updates():
    choice = choose_optimizer(CPU)
    assert choice.value == "adamw_fused" and "fused" in choice.reason

    ours, ref = _model(0), _model(0)
    opt = build_optimizer(ours, lr=1e-2, weight_decay=0.1, choice=choice, betas=(0.9, 0.95))
    assert opt.defaults["fused"] is True
    reference = torch.optim.AdamW(
        param_groups(ref, 0.1), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False, fused=False
    )
    torch.manual_seed(1)
    for _ in range(20):
        x, y = torch.randn(8, 12), torch.randn(8, 5)
        for model, o in ((ours, opt), (ref, reference)):
            o.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(x), y).backward()
            o.step()
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    # Decay reached the matrices and not the vectors: the groups are the reference's.
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


def test_a_device_without_a_fused_kernel_keeps_foreach():
    choice = choose_optimizer(DeviceInfo(type="mps", name="test mps"))
    assert choice.value == "adamw_foreach"
