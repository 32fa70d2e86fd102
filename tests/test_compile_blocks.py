"""`--compile on` compiles a model's decoder layers, one code for all of them (train/compile.py
`Blocks`): one graph for every layer and row count, eager's outputs and gradients, and
nothing compiled outside `compiled()` (the fallback is really eager). The whole run's
compiled losses against eager are tests/test_compile_sdpa_docs.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

from pitstop.tiny import llama_config
from pitstop.train.compile import Blocks, compile_module

VOCAB = 96


def _model(layers: int = 3) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = llama_config(VOCAB, layers=layers, hidden=32, heads=2, max_positions=64)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def _batch(rows: int, width: int = 16, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, width), generator=g)
    # As pitstop's forward calls the model: every row's positions, no key/value cache.
    pos = torch.arange(width).repeat(rows, 1)
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": pos, "use_cache": False}


def _loss_and_grads(forward: Any, model: Any, batch: dict[str, Any]) -> list[Any]:
    loss = forward(**batch).loss
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return [loss.detach(), *grads]


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def test_three_layers_and_three_row_counts_are_one_graph_with_eagers_math(fresh_dynamo):
    model = _model(layers=3)
    blocks = Blocks.of(model, backend="aot_eager")
    assert blocks is not None

    def compiled(**kwargs: Any) -> Any:
        with blocks.compiled():
            return model(**kwargs)

    for rows in (2, 1, 3):  # 1: dynamo specialises a size of 1 unless it is unbacked
        batch = _batch(rows, seed=rows)
        got = _loss_and_grads(compiled, model, batch)
        ref = _loss_and_grads(model, model, batch)
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # Dynamo's own counts: the three layers and three row counts share one graph.
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_outside_compiled_the_blocks_run_their_own_forward(fresh_dynamo):
    model = _model(layers=2)
    blocks = Blocks.of(model, backend="aot_eager")
    assert blocks is not None and not blocks.on
    _loss_and_grads(model, model, _batch(2))
    assert counters["stats"]["unique_graphs"] == 0  # the eager fallback compiles nothing

    with pytest.raises(RuntimeError, match="boom"), blocks.compiled():
        raise RuntimeError("boom")
    assert not blocks.on  # an error inside leaves the blocks eager


def test_blocks_are_found_by_ancestry_and_compile_module_dispatches_to_them():
    model = _model(layers=2)
    layer = type(model.model.layers[0])
    # FSDP2's fully_shard swaps each block's class for one subclass named FSDP<name>.
    renamed = type(f"FSDP{layer.__name__}", (layer,), {})
    for m in model.model.layers:
        m.__class__ = renamed
    blocks = Blocks.of(model, backend="aot_eager")
    assert blocks is not None
    assert all("forward" in vars(m) for m in model.model.layers)  # both dispatch
    assert len(blocks._code) == 1  # one compiled code for the class's forward
    other = _model(layers=2)
    compile_module(other, other, 0, backend="aot_eager")  # rows of one width: the blocks
    assert all("forward" in vars(m) for m in other.model.layers)

    assert Blocks.of(torch.nn.Linear(4, 4)) is None  # names no blocks


def test_the_whole_model_compiles_when_the_width_varies_and_marks_its_inputs(fresh_dynamo):
    model = _model(layers=2)
    forward = compile_module(model, model, 0, dynamic_width=True, backend="aot_eager")
    assert not any("forward" in vars(m) for m in model.model.layers)  # no block dispatch
    batch = _batch(2, width=24)
    got = _loss_and_grads(forward, model, batch)
    for a, b in zip(got, _loss_and_grads(model, model, batch), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] >= 1  # compiled, whole
    for name in ("input_ids", "position_ids"):  # one graph for every row count and width
        assert batch[name]._dynamo_unbacked_indices == {0}, name
        assert 1 in batch[name]._dynamo_weak_dynamic_indices, name


def test_a_model_naming_no_blocks_compiles_whole(fresh_dynamo):
    class Plain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.proj(input_ids)

    plain = Plain()
    forward = compile_module(plain, plain, 0, backend="aot_eager")
    x = torch.randn(3, 5, 4)
    torch.testing.assert_close(forward(input_ids=x), plain(input_ids=x))
    assert counters["stats"]["unique_graphs"] == 1
    assert x._dynamo_unbacked_indices == {0}  # the rows, as a model's batch's
