"""train/guard.py's per-step weight check: True exactly when a parameter holds NaN or ±Inf,
on the CPU's aminmax path, checked against `torch.isfinite` over every element."""

from __future__ import annotations

import pytest
import torch

from pitstop.train.guard import nonfinite_weights


def _params(dtype: torch.dtype) -> list[torch.Tensor]:
    torch.manual_seed(0)
    shapes = [(64, 32), (32,), (1,), (0, 4), (8, 8, 3)]  # an empty one is skipped
    return [torch.nn.Parameter(torch.randn(s, dtype=dtype)) for s in shapes]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), 1e30, 0.0])
@pytest.mark.parametrize("where", [0, 2, 4])
def test_the_check_matches_isfinite(dtype: torch.dtype, bad: float, where: int) -> None:
    params = _params(dtype)
    with torch.no_grad():
        params[where].view(-1)[-1] = bad  # 1e30 is finite in fp32 and bf16, Inf in fp16
    truth = not all(torch.isfinite(p).all() for p in params)
    flag = nonfinite_weights(params)
    assert flag.dim() == 0 and flag.dtype == torch.bool
    assert bool(flag) == truth


def test_large_finite_weights_are_not_called_non_finite() -> None:
    """A 2-norm would overflow at these magnitudes; the largest magnitude does not."""
    params = [torch.nn.Parameter(torch.full((1000,), 3e38))]
    assert not bool(nonfinite_weights(params))


def test_no_parameters_is_finite() -> None:
    assert not bool(nonfinite_weights([torch.nn.Parameter(torch.zeros(0))]))
