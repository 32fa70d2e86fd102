"""`sdpa_docs` under torch.compile: one opaque op (pitstop/train/doc_op.py).

- the op computes what the eager kernel computes, outputs and gradients (fp32 and bf16
  bit for bit on the CPU, windows, grouped heads, one document per row, the GPU's grouped
  recompute path), and passes torch.library's own checks of its fake and autograd;
- refusals stay: a bad offsets tensor, a softcap (`KernelMismatch`) under compile;
- pitstop's compiled training forward over more than ten document layouts: no graph break,
  one graph whatever the row count, and the losses of a compiled run equal an eager one's.

Compiling on a CPU takes tens of seconds: the compiled runs are built once per module.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pitstop.train import doc_attention
from pitstop.train.doc_kernel import per_document_sdpa
from pitstop.train.doc_op import compiled_sdpa_docs, sdpa_docs_op

CU = torch.tensor([0, 10, 40, 64, 100, 128], dtype=torch.int32)  # 5 documents over 2 x 64
ROWS = torch.tensor([0, 64, 128], dtype=torch.int32)  # one document per row
LONG = torch.tensor([0, 600, 1000], dtype=torch.int32)  # one over BAND_BLOCK with a window


def _qkv(dtype: torch.dtype, kv_heads: int, rows: int = 2, width: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((rows, 4, width, 16), (rows, kv_heads, width, 16), (rows, kv_heads, width, 16))
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in shapes]


def _out_and_grads(fn: Any, q, k, v) -> list[torch.Tensor]:
    out = fn(q, k, v)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), grad)]


CASES = [  # (offsets, rows, width, window, group)
    (CU, 2, 64, None, False),
    (CU, 2, 64, 5, False),  # a window shorter than the documents: one banded call each
    (ROWS, 2, 64, None, False),
    (ROWS, 2, 64, 5, False),
    (LONG, 1, 1000, 20, False),  # a document in several blocks of queries
    (CU, 2, 64, 5, True),  # the GPU's plan (grouped calls): the recompute backward
    (CU, 2, 64, None, True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_op_computes_the_eager_kernels_outputs_and_gradients(dtype, kv_heads, case) -> None:
    cu, rows, width, window, group = CASES[case]
    kw = {"window": window, "group": group}
    q, k, v = _qkv(dtype, kv_heads, rows, width)
    ref = _out_and_grads(lambda *t: per_document_sdpa(*t, cu, **kw), q, k, v)
    got = _out_and_grads(lambda *t: sdpa_docs_op(*t, cu, None, window, group, 32)[0], q, k, v)
    for a, b in zip(got, ref, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same kernels, bit for bit


def test_under_autocast_the_op_casts_as_sdpa_does_and_keeps_its_gradients() -> None:
    """Under bf16 autocast a Llama's query and key leave the rotary embedding in fp32 and the
    value is bf16: SDPA's autocast rule casts all three, and so does the op's wrapper, whose
    backward (run outside the caller's autocast) still sees the forward's dtypes."""
    q, k, v = _qkv(torch.float32, 2)
    v16 = v.detach().to(torch.bfloat16).requires_grad_()

    def run(fn: Any) -> list[torch.Tensor]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(q, k, v16, CU, window=5)
        g = torch.ones_like(out)
        return [out.detach(), *torch.autograd.grad(out, (q, k, v16), g)]

    ref, got = run(per_document_sdpa), run(compiled_sdpa_docs)
    for a, b in zip(got, ref, strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_torch_library_checks_the_ops_registration() -> None:
    """opcheck: the fake gives the real shapes and strides, autograd is registered, the
    schema holds; for the CPU's saved log-sum-exp path and the recompute path."""
    q, k, v = _qkv(torch.float32, 2)
    for window, group in ((None, False), (5, False), (5, True)):
        torch.library.opcheck(sdpa_docs_op, (q, k, v, CU, None, window, group, 32))


def test_bad_offsets_are_refused_inside_the_op() -> None:
    q, k, v = _qkv(torch.float32, 2)
    bad = torch.tensor([0, 10, 100], dtype=torch.int32)  # ends before B*T = 128
    with pytest.raises(ValueError, match="must run from 0 to B\\*T = 128"):
        sdpa_docs_op(q, k, v, bad, None, None, False, 32)


def test_a_softcap_is_still_refused_under_compile() -> None:
    """The refusal happens in the traced kernel, before the op: compile does not hide it."""

    class Layer(torch.nn.Module):
        is_causal = True
        training = False

    layer = Layer()

    def attend(q, k, v):
        return doc_attention.doc_sdpa_attention(
            layer, q, k, v, None, softcap=50.0, cu_seq_lens_q=CU
        )[0]

    q, k, v = _qkv(torch.float32, 2)
    torch._dynamo.reset()
    with pytest.raises(doc_attention.KernelMismatch, match="logit softcap"):
        torch.compile(attend, backend="eager")(q, k, v)
    torch._dynamo.reset()


# --- pitstop's compiled training forward over many document layouts ------------------------

STEPS = 20
# Compiled against eager fp32 over 20 steps: inductor fuses and reorders reductions, so the
# losses agree to float rounding (measured: 1.2e-7 relative at most), the golden tests' 1e-5.
FP32_RTOL = 1e-5


class _Recording:
    """Trainer mix-in: the document layouts (offsets) of the micro-batches it ran compiled
    (a run that measures compile's payoff runs its first steps eagerly)."""

    layouts: set[tuple[int, ...]]
    rows: list[int]  # each compiled micro-batch's row count, in order

    def to_device(self, mb):
        batch = super().to_device(mb)  # type: ignore[misc]
        timing = self.run.compile_timing  # type: ignore[attr-defined]
        if self.run.compiled and (timing is None or not timing.eager_now()):  # type: ignore[attr-defined]
            self.layouts.add(tuple(batch["cu_seq_lens_q"].tolist()))
            self.rows.append(int(batch["input_ids"].shape[0]))
        return batch


def _train(model_dir: Path, store: Path, out: Path, compile_: str) -> dict[str, Any]:
    from _train_util import train_config
    from torch._dynamo.utils import counters

    from pitstop.train.trainer import Trainer

    class Recording(_Recording, Trainer):
        pass

    # seed 5: the step of 5 rows (a micro-batch of one row) is step 16, a compiled one (the
    # measuring schedule runs steps 1, 4-5, 7-8 and 10-11 eagerly)
    cfg = train_config(
        model_dir, store, out, attention="sdpa_docs", compile=compile_, max_steps=STEPS,
        log_steps=1, seed=5,
    )  # fmt: skip
    torch._dynamo.reset()
    counters.clear()
    trainer = Recording.from_config(cfg, save_final=False)
    trainer.layouts, trainer.rows = set(), []
    summary = trainer.fit()
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    result = {
        "losses": [r["loss"] for r in lines],
        "layouts": trainer.layouts,
        "rows": trainer.rows,
        "graphs": counters["stats"]["unique_graphs"],
        "breaks": dict(counters["graph_break"]),
        "compiled": summary.to_json()["choices"]["compile"]["value"],
        "compile": summary.to_json()["choices"]["compile"],
        "config": cfg,
    }
    torch._dynamo.reset()
    return result


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tiny_tokenizer, tmp_path_factory) -> dict[str, dict[str, Any]]:
    """A compiled and an eager run of the same config over documents of 5 to 60 tokens
    packed into rows of 64: nearly every micro-batch a layout of its own."""
    tmp = tmp_path_factory.mktemp("compile")
    store = _varied_store(tmp / "store", tiny_tokenizer)
    return {mode: _train(tiny_model_dir, store, tmp / mode, mode) for mode in ("on", "off")}


def _varied_store(dest: Path, tokenizer: Any) -> Path:
    """The bundled corpus cut into documents of random lengths (5 to 60 tokens, seeded)."""
    import numpy as np

    from pitstop.core.corpus import sample_texts
    from pitstop.data.store import StoreWriter

    rng = np.random.default_rng(0)
    ids = np.asarray(tokenizer("\n".join(sample_texts(30)))["input_ids"])
    cuts = np.cumsum(rng.integers(5, 61, size=len(ids) // 5))
    lens = np.diff(np.concatenate([[0], cuts[cuts < len(ids)]])).tolist()
    toks = ids[: sum(lens)]
    mask = np.ones(len(toks), np.uint8)
    mask[np.cumsum([0, *lens[:-1]])] = 0  # a document's first token is never a target
    w = StoreWriter(dest, vocab_size=len(tokenizer))
    w.append(toks, mask, lens, list(range(len(lens))))
    w.finish({"max_seq_len": 64, "eos_token_id": tokenizer.eos_token_id,
              "pad_token_id": tokenizer.pad_token_id})  # fmt: skip
    return dest


@pytest.mark.slow
def test_a_compiled_run_has_no_graph_break_and_one_graph_over_its_layouts_and_row_counts(runs):
    """Over more than ten document layouts and micro-batches of 2 rows and of 1 (steps of 3
    and 5 packed rows), dynamo's own count: one graph, no break. A size of 1 is a graph of
    its own unless the row count is marked unbacked (train/compile.py `mark_rows_dynamic`):
    the headline's one-row micro-batch recompiled for 21-27 s on a cold cache before."""
    on = runs["on"]
    assert on["compiled"] is True
    assert len(on["layouts"]) >= 10, "the test needs at least ten document layouts"
    assert set(on["rows"]) == {1, 2}, "the test needs micro-batches of one row and of two"
    assert on["breaks"] == {}
    assert on["graphs"] == 1, on


@pytest.mark.slow
def test_the_compiled_run_measured_compile_and_the_next_auto_run_decides_with_it(runs):
    """No measurement of this configuration was cached: the run ran its first step eagerly,
    then compiled, timed eager steps between compiled ones, and recorded what the compile
    cost and gained; a run of the same
    configuration with `compile: auto` decides from that record, with its numbers."""
    import dataclasses

    from pitstop.train.build import build_run

    measured = runs["on"]["compile"]["measured"]["measured"]
    assert measured["compile_seconds"] > 0 and measured["eager_step_seconds"] > 0
    assert measured["source"].startswith("measured on this run's steps (3 eager steps, each")
    assert measured["pairs"] == 3  # 20 steps: the three pairs after the compile, no later one
    ran = runs["on"]["config"]
    cfg = dataclasses.replace(ran, compile="auto", output=str(Path(ran.output) / "next"))
    choice = build_run(cfg).choices["compile"]
    assert "reused (cached in" in choice.reason, choice.reason
    assert choice.measured["compile_seconds"] == pytest.approx(measured["compile_seconds"])
    assert choice.measured["steps"] == STEPS


@pytest.mark.slow
def test_a_compiled_run_trains_the_eager_runs_losses(runs):
    on, off = runs["on"], runs["off"]
    assert off["compiled"] is False and off["graphs"] == 0
    assert len(on["losses"]) == len(off["losses"]) == STEPS
    assert on["losses"] == pytest.approx(off["losses"], rel=FP32_RTOL)


# Compiled against eager under bf16 autocast over 20 optimizer steps: the fused kernels
# round bf16 intermediates in other places than the eager ones (measured: 4.7e-5 relative
# at most on this model and data; the same loop in fp32 8.8e-8).
BF16_RTOL = 1e-3


@pytest.mark.slow
def test_under_bf16_autocast_compiled_training_keeps_the_eager_losses() -> None:
    """20 AdamW steps of a tiny Llama with sdpa_docs over 20 packed layouts under bf16
    autocast (fp32 master weights, pitstop's loss), compiled as `--compile on` compiles the
    model, against the same steps eager. The precision pitstop would pick on this CPU does
    not matter: autocast to bf16 runs on any CPU."""
    from bench.gpu_checks_train import layouts
    from bench.gpu_checks_util import tiny_llama
    from pitstop.train.forward import to_device, token_loss_sum

    dev = torch.device("cpu")
    batches = [to_device(mb, dev, "sdpa_docs") for mb in layouts(STEPS, rows=2, width=64)]

    def train(compiled: bool) -> list[float]:
        model = tiny_llama("sdpa_docs", dev, hidden=64)
        forward = torch.compile(model) if compiled else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        losses = []
        for b in batches:
            loss = token_loss_sum(forward, b, "cpu", torch.bfloat16) / b["labels"].numel()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss))
        return losses

    torch._dynamo.reset()
    try:
        got = train(compiled=True)
    finally:
        torch._dynamo.reset()
    ref = train(compiled=False)
    assert got == pytest.approx(ref, rel=BF16_RTOL)
    assert got != ref  # bf16 rounding differs somewhere: the two really ran differently


@pytest.mark.parametrize(("batching", "blocks"), [("bucket", False), ("pack", True)])
def test_a_compiled_bucket_run_compiles_whole_and_pack_compiles_the_layers(
    tiny_model_dir, store, tmp_path, batching, blocks
):
    """pack's rows are all max_seq_len wide: its decoder layers compile as one code
    (train/compile.py `Blocks`). bucket's are as wide as each micro-batch's longest: the
    whole model compiles, its width dynamic (tests/test_compile_blocks.py checks the marks
    each path puts on what it compiles). Nothing is compiled here (no forward)."""
    from _train_util import train_config

    from pitstop.train.trainer import Trainer

    cfg = train_config(tiny_model_dir, store, tmp_path / "out", compile="on", batching=batching)
    trainer = Trainer.from_config(cfg, save_final=False)
    layers = trainer.run.model.model.layers
    assert all(("forward" in vars(m)) is blocks for m in layers), batching
    batch = trainer.to_device(next(iter(trainer.run.loader)))
    assert 0 in batch["cu_seq_lens_q"]._dynamo_weak_dynamic_indices  # the documents' count
