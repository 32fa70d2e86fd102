"""The self-test's checks with two processes (bench/gpu_selftest.py; docs/gpu.md), one per
GPU over NCCL (the CPU's dry run: two processes over gloo):

- a DDP step and an FSDP2 step through pitstop's wrapper (`distributed.wrap`, `no_sync`,
  the trainer's loss scaling): gradients equal those of one process over all the
  micro-batches, and after the optimizer step every rank holds the same parameters;
- DDP accumulation memory (two GPUs only): the peak of a real DDP step with two
  micro-batches stays within the micro-batch sizer's prediction for a DDP run.

Each rank writes its results to a JSON file; the parent turns them into rows. A rank that
hangs is killed after `DEADLINE_S`.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from bench.gpu_checks_util import Row, free_port, short_error, tiny_llama

WORLD = 2
DEADLINE_S = 180.0
GRAD_TOLERANCE = 1e-4  # fp32, TF32 off: summation order only


def _micro_batches(n: int, *, rows: int = 2, width: int = 64) -> list[dict[str, torch.Tensor]]:
    """`n` host micro-batches of two documents a row (different tokens each)."""
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(n):
        ids = torch.randint(1, 256, (rows, width), generator=g)
        cut = width // 2 - 8 + 4 * i
        pos = torch.cat([torch.arange(cut), torch.arange(width - cut)]).repeat(rows, 1)
        out.append({"input_ids": ids, "labels": ids.clone(), "position_ids": pos})
    return out


def _full(t: Any) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _optimizer_choice(dev: torch.device) -> Any:
    from pitstop.probe import Choice

    return Choice("adamw_fused" if dev.type == "cuda" else "adamw_foreach", "selftest")


def _step(strategy: str, rank: int, dev: torch.device, backend: str) -> dict[str, Any]:
    """One optimizer step of `strategy` with two micro-batches on this rank; the gradient's
    largest relative difference from one process over every rank's micro-batches, and the
    largest difference between ranks' parameters after the step."""
    import torch.distributed as dist

    from pitstop.core.config import RunConfig
    from pitstop.train import distributed as dist_mod
    from pitstop.train.forward import to_device, token_loss_sum
    from pitstop.train.optim import build_optimizer
    from pitstop.train.token_loss import shifted_targets

    every = _micro_batches(2 * WORLD)
    mine = every[2 * rank : 2 * rank + 2]
    targets = sum(int((shifted_targets(mb["labels"]) != -100).sum()) for mb in every)

    reference = tiny_llama("sdpa", dev)  # one process, every micro-batch, the same init
    for mb in every:
        (token_loss_sum(reference, to_device(mb, dev, "sdpa"), dev.type, None) / targets).backward()

    model = tiny_llama("sdpa", dev)
    cfg = RunConfig(model="m", data="d", output="o", strategy=strategy)
    env = dist_mod.DistEnv(rank, WORLD, rank, backend)
    wrapped, _ = dist_mod.wrap(model, cfg, env, precision="fp32")
    for i, mb in enumerate(mine):
        last = i == len(mine) - 1
        with dist_mod.no_sync(wrapped, strategy, last):
            loss = token_loss_sum(wrapped, to_device(mb, dev, "sdpa"), dev.type, None) / targets
            (loss * WORLD).backward()  # the trainer's scaling: DDP/FSDP average over ranks
    worst = 0.0
    for p, r in zip(model.parameters(), reference.parameters(), strict=True):
        g = _full(p.grad).detach()
        scale = r.grad.abs().max().clamp_min(1e-12)
        worst = max(worst, float((g - r.grad).abs().max() / scale))
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.0, choice=_optimizer_choice(dev))
    opt.step()
    flat = torch.cat([_full(p.detach()).float().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(WORLD)]
    dist.all_gather(gathered, flat)
    apart = max(float((g - gathered[0]).abs().max()) for g in gathered)
    return {"grad_rel": worst, "ranks_apart": apart, "parameters": flat.numel()}


def _ddp_memory(rank: int, dev: torch.device, backend: str) -> dict[str, Any]:
    """Peak of a DDP step with two micro-batches (and a second step's backwards with the
    optimizer's moments alive) against the sizer's DDP prediction, measured on the bare
    model before wrapping as `pitstop train` does."""
    from pitstop.core.config import RunConfig
    from pitstop.train import distributed as dist_mod
    from pitstop.train.forward import to_device, token_loss_sum
    from pitstop.train.memory_plan import cuda_sizer
    from pitstop.train.optim import build_optimizer

    autocast = torch.bfloat16
    model = tiny_llama("sdpa", dev, layers=4, hidden=512, heads=8, kv_heads=2)
    choice = _optimizer_choice(dev)
    mbs = _micro_batches(2, rows=4, width=512)
    sizer = cuda_sizer(model, dev, "sdpa", autocast, choice, ddp=True)
    measured, _ = sizer.measure(mbs[0])
    predicted = measured + sizer.reserved_bytes
    cfg = RunConfig(model="m", data="d", output="o", strategy="ddp")
    env = dist_mod.DistEnv(rank, WORLD, rank, backend)
    wrapped, _ = dist_mod.wrap(model, cfg, env, precision="bf16")
    opt = build_optimizer(model, lr=1e-4, weight_decay=0.0, choice=choice)
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    for _ in range(2):  # the second step runs with the moments alive
        for i, mb in enumerate(mbs):
            with dist_mod.no_sync(wrapped, "ddp", i == len(mbs) - 1):
                token_loss_sum(wrapped, to_device(mb, dev, "sdpa"), dev.type, autocast).backward()
        opt.step()
        zero = getattr(dist_mod, "zero_grad", None)
        if zero is not None:
            zero(opt, wrapped)
        else:
            opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize(dev)
    return {
        "predicted": predicted, "measured": measured, "reserved": sizer.reserved_bytes,
        "actual": float(torch.cuda.max_memory_allocated(dev)),
    }  # fmt: skip


def _worker(rank: int, port: int, device_type: str, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    cuda = device_type == "cuda"
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    backend = "nccl" if cuda else "gloo"
    kw: dict[str, Any] = {}
    if cuda:
        torch.cuda.set_device(dev)
        kw["device_id"] = dev
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    result: dict[str, Any] = {}
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
        timeout=timedelta(seconds=60), **kw,
    )  # fmt: skip
    try:
        for strategy in ("ddp", "fsdp"):
            try:
                result[strategy] = _step(strategy, rank, dev, backend)
            except Exception as e:
                result[strategy] = {"error": short_error(e)}
        if cuda:
            try:
                result["memory"] = _ddp_memory(rank, dev, backend)
            except Exception as e:
                result["memory"] = {"error": short_error(e)}
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result), encoding="utf-8")
        dist.destroy_process_group()


def run_workers(device_type: str, out_dir: str) -> str | None:
    """Start the two ranks and wait for them; why they did not finish, or None."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(
        _worker, args=(free_port(), device_type, out_dir), nprocs=WORLD, join=False,
        start_method="spawn",
    )  # fmt: skip
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                return f"the ranks did not finish within {DEADLINE_S:.0f} s (killed)"
    except Exception as e:  # a rank raised or died
        return short_error(e, 400)
    return None


def _rows(results: list[dict[str, Any]], cuda: bool, world_note: str) -> list[Row]:
    rows = []
    for strategy, label in (("ddp", "DDP"), ("fsdp", "FSDP2")):
        name = f"two GPUs: {label} step"
        got = [r.get(strategy, {"error": "no result"}) for r in results]
        errors = [f"rank {i}: {g['error']}" for i, g in enumerate(got) if "error" in g]
        if errors:
            rows.append(Row(name, "FAIL", "; ".join(errors)))
            continue
        grad = max(g["grad_rel"] for g in got)
        apart = max(g["ranks_apart"] for g in got)
        ok = grad <= GRAD_TOLERANCE and apart == 0.0
        rows.append(Row(name, "pass" if ok else "FAIL",
                        f"{world_note}fp32, 2 micro-batches a rank through pitstop's wrapper: "
                        f"gradients vs one process over all of them, largest relative "
                        f"difference {grad:.1e} (tolerance {GRAD_TOLERANCE:.0e}); parameters "
                        f"after the step, largest difference between ranks {apart:.1e} "
                        f"(must be 0; {got[0]['parameters']:,} values)"))  # fmt: skip
    name = "DDP accumulation memory vs sizer"
    if not cuda:
        rows.append(Row(name, "skip", "the sizer measures CUDA memory"))
        return rows
    got = [r.get("memory", {"error": "no result"}) for r in results]
    errors = [f"rank {i}: {g['error']}" for i, g in enumerate(got) if "error" in g]
    if errors:
        rows.append(Row(name, "FAIL", "; ".join(errors)))
        return rows
    parts, ok = [], True
    for i, g in enumerate(got):
        ok &= g["actual"] <= g["predicted"] * 1.05
        parts.append(
            f"rank {i}: predicted {g['predicted'] / 2**20:.1f} MiB (measured "
            f"{g['measured'] / 2**20:.1f} + reserved {g['reserved'] / 2**20:.1f}), actual "
            f"{g['actual'] / 2**20:.1f} MiB"
        )
    rows.append(Row(name, "pass" if ok else "FAIL",
                    "two DDP steps of 2 micro-batches, bf16 autocast, 5% slack: "
                    + "; ".join(parts)))  # fmt: skip
    return rows


def check_multi(dev: torch.device, precision: str) -> list[Row]:
    import tempfile

    cuda = dev.type == "cuda"
    if cuda and torch.cuda.device_count() < WORLD:
        why = f"needs {WORLD} GPUs, this machine has {torch.cuda.device_count()}"
        return [Row("two GPUs: DDP step", "skip", why), Row("two GPUs: FSDP2 step", "skip", why),
                Row("DDP accumulation memory vs sizer", "skip", why)]  # fmt: skip
    note = "" if cuda else "CPU dry run (2 processes, gloo): "
    with tempfile.TemporaryDirectory() as out_dir:
        failure = run_workers(dev.type, out_dir)
        results = []
        for rank in range(WORLD):
            path = Path(out_dir, f"rank{rank}.json")
            results.append(json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {})
    rows = _rows(results, cuda, note)
    if failure:
        for r in rows:
            if r.status != "skip":
                r.status = "FAIL"
                r.detail = f"{failure}; {r.detail}"
    return rows
