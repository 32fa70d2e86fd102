"""The training loss computed a block of rows at a time (pitstop/train/token_loss.py) is the
same math as F.cross_entropy over fp32 logits: the value and the gradient, ignored targets
included, in fp32 and under bf16 logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pitstop.train.token_loss import (
    IGNORE_INDEX,
    chunked_token_ce,
    shifted_targets,
    token_ce_sum,
)


def _reference(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """What pitstop computed before: slice the logits, not the labels; fp32 cross-entropy."""
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
        ignore_index=IGNORE_INDEX, reduction="sum",
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_rows", [None, 1, 7, 1000])
def test_value_and_gradient_equal_fp32_cross_entropy(dtype, block_rows):
    g = torch.Generator().manual_seed(0)
    B, T, V = 3, 17, 50
    base = torch.randn(B, T, V, generator=g) * 4
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, :5] = IGNORE_INDEX  # a prompt: no loss there
    labels[2, -3:] = IGNORE_INDEX

    ref_in = base.to(dtype).requires_grad_()
    ref = _reference(ref_in, labels)
    ref.backward()

    x = base.to(dtype).requires_grad_()
    got = chunked_token_ce(x.flatten(0, 1), shifted_targets(labels), block_rows)
    got.backward()

    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(ref.item(), rel=1e-6)
    assert x.grad is not None and x.grad.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: the gradient is rounded to bf16
    assert torch.allclose(x.grad.float(), ref_in.grad.float(), atol=tol, rtol=0)
    # Rows that predict nothing get exactly no gradient: each row's last position, ignored ones.
    assert torch.all(x.grad[:, -1] == 0)
    assert torch.all(x.grad[0, :4] == 0)


def test_the_last_position_of_each_row_predicts_nothing():
    labels = torch.tensor([[1, 2, 3], [4, 5, IGNORE_INDEX]])
    assert shifted_targets(labels).tolist() == [2, 3, IGNORE_INDEX, 5, IGNORE_INDEX, IGNORE_INDEX]


def test_all_targets_ignored_gives_zero_loss_and_zero_gradient():
    x = torch.randn(4, 9, requires_grad=True)
    loss = token_ce_sum(x, torch.full((4,), IGNORE_INDEX))
    loss.backward()
    assert loss.item() == 0.0 and torch.all(x.grad == 0)


def test_a_wrong_shape_says_what_it_needs():
    with pytest.raises(ValueError, match=r"logits \[N, V\] and targets \[N\]"):
        chunked_token_ce(torch.zeros(2, 3, 4), torch.zeros(2, dtype=torch.long))


def test_a_scaled_loss_scales_the_gradient():
    """The trainer divides by the step's target count before backward: grad_out != 1."""
    g = torch.Generator().manual_seed(1)
    base = torch.randn(6, 11, generator=g)
    t = torch.randint(0, 11, (6,), generator=g)
    a = base.clone().requires_grad_()
    (chunked_token_ce(a, t, 4) / 13).backward()
    b = base.clone().requires_grad_()
    (F.cross_entropy(b, t, reduction="sum") / 13).backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-7)
