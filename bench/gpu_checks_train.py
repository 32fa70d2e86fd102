"""The self-test's checks of the training step (bench/gpu_selftest.py; docs/gpu.md):

- `check_compile_ddp`: `--compile on` compiles the DDP wrapper and falls back to it;
- `check_fsdp_mp`: FSDP2's bf16 policy runs and matches the unsharded autocast loss;
- `check_syncs`: three steps of pitstop's own Trainer under
  `torch.cuda.set_sync_debug_mode("error")`: a step that waits for the device fails;
- `check_recompiles`: a compiled model with `sdpa_docs` over ten document layouts: at most
  2 graphs, no graph break, and eager's loss and gradients.
"""

from __future__ import annotations

import contextlib
import random
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from bench.gpu_checks_util import (
    Row,
    WorldOfOne,
    batch,
    relative_difference,
    short_error,
    tiny_llama,
    where_raised,
)

SYNC_STEPS = 3
LAYOUTS = 10


def check_compile_ddp(dev: torch.device, precision: str) -> list[Row]:
    from torch.nn.parallel import DistributedDataParallel

    from pitstop.core.config import RunConfig
    from pitstop.train import distributed as dist_mod
    from pitstop.train.compile import GuardedForward, compile_module
    from pitstop.train.forward import token_loss_sum

    name = "compile + DDP wrapping"
    autocast = torch.bfloat16 if precision == "bf16" else None
    with WorldOfOne(dev):
        model = tiny_llama("sdpa", dev)
        cfg = RunConfig(model="m", data="d", output="o", strategy="ddp")
        env = dist_mod.DistEnv(0, 2, 0, "nccl" if dev.type == "cuda" else "gloo")
        wrapped, _ = dist_mod.wrap(model, cfg, env)
        guard = GuardedForward(wrapped, compile_module(wrapped, model, 0))
        if not isinstance(guard.eager, DistributedDataParallel):
            return [Row(name, "FAIL", f"fallback is {type(guard.eager).__name__}, not DDP")]
        mb = batch(dev)
        token_loss_sum(guard, mb, dev.type, autocast).backward()
        if guard.failed:
            return [Row(name, "FAIL", f"compile fell back: {guard.failure}")]
        compiled = [p.grad.detach().clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        token_loss_sum(wrapped, mb, dev.type, autocast).backward()
        worst = max(
            float((a - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-12))
            for a, p in zip(compiled, model.parameters())
        )
    tol = 5e-2 if precision == "bf16" else 1e-3
    ok = worst <= tol and bool(wrapped.gradient_as_bucket_view)
    return [Row(name, "pass" if ok else "FAIL",
                f"compiled the blocks inside the DDP wrapper; fallback is the wrapper; "
                f"gradients vs eager: largest relative difference {worst:.1e} (tolerance "
                f"{tol:.0e}); bucket views "
                f"{wrapped.gradient_as_bucket_view}")]  # fmt: skip


def check_fsdp_mp(dev: torch.device, precision: str) -> list[Row]:
    from pitstop.core.config import RunConfig
    from pitstop.train import distributed as dist_mod
    from pitstop.train.forward import token_loss_sum

    name = "FSDP2 mixed precision"
    if precision != "bf16":
        return [Row(name, "skip", "a bf16 policy needs a bf16 run (a GPU)")]
    mb = batch(dev)
    ref = token_loss_sum(tiny_llama("sdpa", dev), mb, dev.type, torch.bfloat16)
    with WorldOfOne(dev):
        model = tiny_llama("sdpa", dev)
        cfg = RunConfig(model="m", data="d", output="o", strategy="fsdp")
        env = dist_mod.DistEnv(0, 2, 0, "nccl")
        wrapped, choice = dist_mod.wrap(model, cfg, env, precision="bf16")
        loss = token_loss_sum(wrapped, mb, dev.type, torch.bfloat16)
        loss.backward()
        grads_fp32 = all(
            p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters()
        )
    rel = float((loss.detach() - ref.detach()).abs() / ref.detach().abs())
    ok = rel <= 2e-2 and grads_fp32 and "bf16 all-gather" in choice.reason
    return [Row(name, "pass" if ok else "FAIL",
                f"loss vs unsharded autocast: relative difference {rel:.1e} (tolerance 2e-2); "
                f"fp32 gradient shards {grads_fp32}")]  # fmt: skip


# --- host-device syncs in the step ---------------------------------------------------------


def small_trainer(
    tmp: Path, dev: torch.device, *, steps: int = SYNC_STEPS, attention: str = "auto"
) -> Any:
    """pitstop's Trainer on a tiny Llama directory and a token store built in `tmp` (once):
    packed rows of 64, two micro-batches per step, the precision pitstop takes on this
    device and `attention` (auto: the kernel pitstop picks here)."""
    from transformers.utils import logging as hf_logging

    from bench.common import corpus_store
    from pitstop.core.config import build_config
    from pitstop.core.corpus import sample_texts
    from pitstop.tiny import build_model_dir
    from pitstop.train.trainer import Trainer

    hf_logging.disable_progress_bar()  # save_pretrained's shard bar
    model_dir = build_model_dir(tmp / "model", texts=sample_texts(20), vocab_size=512)
    store = tmp / "store"
    if not (store / "manifest.json").is_file():  # built once for every trainer in `tmp`
        corpus_store(store, model_dir, n_docs=12, max_len=64)
    cfg = build_config(
        {
            "model": str(model_dir), "data": [str(store)], "output": str(tmp / f"run-{attention}"),
            "attention": attention,
            "device": dev.type, "max_seq_len": 64, "tokens_per_step": 256,
            "micro_batch_size": 2, "batching": "pack", "max_steps": steps,
            "log_steps": 1000, "report_to": ["none"], "compile": "off",
            "cache_dir": str(tmp / "cache"), "precision": "bf16" if dev.type == "cuda" else "fp32",
        },
        None,
    )  # fmt: skip
    return Trainer.from_config(cfg, save_final=False)


@contextlib.contextmanager
def quiet_pitstop() -> Iterator[None]:
    """pitstop's banner and progress lines off (warnings still show)."""
    from pitstop.core import log

    level = log.logger.level
    log.set_level("warning")
    try:
        yield
    finally:
        log.logger.setLevel(level)


@contextlib.contextmanager
def packed_detection_allowed(calls: list[int]) -> Iterator[None]:
    """transformers' packed-row detection (masking_utils.find_packed_sequence_indices reads
    one flag per mask it builds) runs with the sync check off: a documented sync that is not
    pitstop's to remove (docs/gpu.md, "Known and left alone"). `calls` counts them."""
    from transformers import masking_utils

    real = masking_utils.find_packed_sequence_indices

    def allowed(position_ids: torch.Tensor) -> Any:
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(0)
        try:
            return real(position_ids)
        finally:
            torch.cuda.set_sync_debug_mode(mode)
            calls[0] += 1

    masking_utils.find_packed_sequence_indices = allowed
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = real


def check_syncs(dev: torch.device, precision: str) -> list[Row]:
    """The kernel pitstop picks here, and sdpa_docs (pitstop's own) when that is another."""
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp, quiet_pitstop():
        first = small_trainer(Path(tmp), dev)
        auto = first.run.choices["attention"].value
        kernels = [auto] + (["sdpa_docs"] if auto != "sdpa_docs" and dev.type == "cuda" else [])
        for kernel in kernels:
            try:
                trainer = (
                    first if kernel == auto else small_trainer(Path(tmp), dev, attention=kernel)
                )
                rows.append(sync_row(trainer, dev))
            except Exception as e:
                rows.append(Row(f"no host-device sync in a step: {kernel}", "FAIL",
                                f"raised {short_error(e)}"))  # fmt: skip
    return rows


def sync_row(trainer: Any, dev: torch.device) -> Row:
    """Run `trainer` (SYNC_STEPS steps) with each step under the sync debug mode "error"."""
    attention = trainer.run.choices["attention"].value
    name = f"no host-device sync in a step: {attention}"
    what = (f"{SYNC_STEPS} steps of pitstop's Trainer ({attention}, {trainer.run.precision}, "
            "packed rows, 2 micro-batches a step)")  # fmt: skip
    if dev.type != "cuda":
        trainer.fit()
        return Row(name, "skip", f"CPU dry run: {what} ran; the sync debug mode is CUDA's")
    real_step = trainer._train_step
    done = [0]

    def checked_step(tl: Any) -> None:
        torch.cuda.set_sync_debug_mode("error")
        try:
            real_step(tl)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        done[0] += 1

    trainer._train_step = checked_step  # the loop calls self._train_step(tl)
    detections = [0]
    # sdpa_docs passes a marker mask, so transformers' detection must not run at all there
    # (train/attention.py boundaries_only_mask): its read is allowed to the other kernels.
    allowance = (
        contextlib.nullcontext() if attention == "sdpa_docs"
        else packed_detection_allowed(detections)
    )  # fmt: skip
    try:
        with allowance:
            trainer.fit()
    except RuntimeError as e:
        if "synchroniz" not in str(e):
            raise
        return Row(name, "FAIL",
                   f"step {done[0] + 1} of {what} waited for the device at {where_raised(e)}: "
                   f"{short_error(e, 160)}")  # fmt: skip
    if done[0] < SYNC_STEPS:
        return Row(name, "FAIL", f"only {done[0]} of {SYNC_STEPS} steps ran: {what}")
    return Row(name, "pass",
               f"{what} under torch.cuda.set_sync_debug_mode('error'): no sync; transformers' "
               f"packed-row detection was allowed its documented flag read {detections[0]} "
               "times (docs/gpu.md, Known and left alone)")  # fmt: skip


# --- recompiles per document layout ----------------------------------------------------------


def layouts(n: int, *, rows: int = 2, width: int = 256, seed: int = 0) -> list[dict[str, Any]]:
    """`n` host micro-batches of the same shape, each with its own documents per row."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        pos = []
        for _ in range(rows):
            cuts = sorted(rng.sample(range(8, width - 8), rng.randint(1, 5)))
            lens = [b - a for a, b in zip([0, *cuts], [*cuts, width])]
            pos.append(torch.cat([torch.arange(m) for m in lens if m > 0]))
        ids = torch.randint(1, 256, (rows, width), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone(), "position_ids": torch.stack(pos)})
    return out


def check_recompiles(dev: torch.device, precision: str) -> list[Row]:
    """A compiled tiny Llama with sdpa_docs, its two decoder layers compiled as `--compile on`
    compiles them (train/compile.py `Blocks`: one code for both), over ten document layouts
    and micro-batches of 2 rows and of 1: one graph, no graph break, and each layout's loss
    and gradients as eager's.

    sdpa_docs is one opaque op under compile (pitstop/train/doc_op.py), its offsets a
    dynamic size: a new layout is not a new graph; the row count is unbacked
    (`Blocks` marks the layers' inputs): one row is not a graph of its own. On a GPU
    the compiler is inductor (what `--compile on` runs); on the CPU (`--cpu`) aot_eager,
    which traces the op's fake and its backward as inductor does without minutes of code
    generation (the CPU's inductor runs are tests/test_compile_sdpa_docs.py)."""
    from torch._dynamo.utils import counters

    from pitstop.train.compile import Blocks
    from pitstop.train.forward import to_device

    name = "compile: recompiles per document layout"
    autocast = torch.bfloat16 if precision == "bf16" else None
    backend = "inductor" if dev.type == "cuda" else "aot_eager"
    model = tiny_llama("sdpa_docs", dev)
    torch._dynamo.reset()
    counters.clear()
    new: list[int] = []
    worst = 0.0
    try:
        blocks = Blocks.of(model, backend=backend)
        if blocks is None:
            return [Row(name, "FAIL", "no decoder layers found to compile")]

        def compiled(**kwargs: Any) -> Any:
            with blocks.compiled():
                return model(**kwargs)

        one_row = layouts(LAYOUTS // 3, rows=1, seed=1)  # every third micro-batch
        two_rows = layouts(LAYOUTS - len(one_row))
        mixed = [one_row.pop() if i % 3 == 2 else two_rows.pop() for i in range(LAYOUTS)]
        for i, mb in enumerate(mixed):
            batch = to_device(mb, dev, "sdpa_docs")
            before = counters["stats"]["unique_graphs"]
            got = _loss_and_grads(compiled, model, batch, dev, autocast)
            if counters["stats"]["unique_graphs"] > before:
                new.append(i + 1)
            ref = _loss_and_grads(model, model, batch, dev, autocast)
            worst = max(worst, *(relative_difference(a, b) for a, b in zip(got, ref)))
        graphs = counters["stats"]["unique_graphs"]
        breaks = sum(counters["graph_break"].values())
    finally:
        torch._dynamo.reset()
    tol = 5e-2 if precision == "bf16" else 1e-3
    ok = graphs == 1 and breaks == 0 and worst <= tol
    detail = (
        f"torch.compile ({backend}) of a tiny Llama's 2 layers with sdpa_docs over {LAYOUTS} "
        f"document layouts of 2 x 256 and 1 x 256 tokens: new graphs for {len(new)} of them "
        f"(layouts {new}), {graphs} graphs in all (one), {breaks} graph breaks (none); loss "
        f"and gradients vs eager: largest relative difference {worst:.1e} (tolerance {tol:.0e})"
    )
    return [Row(name, "pass" if ok else "FAIL", detail)]


def _loss_and_grads(
    forward: Any, model: Any, batch: Any, dev: torch.device, autocast: torch.dtype | None
) -> list[torch.Tensor]:
    """[loss, every parameter's gradient] of one forward+backward through `forward`."""
    from pitstop.train.forward import token_loss_sum

    loss = token_loss_sum(forward, batch, dev.type, autocast)
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return [loss.detach(), *grads]
