"""What only a GPU can settle (issue 26), checked on yours: a pass/fail table.

    python -m bench.gpu_selftest            # on a CUDA machine: every check, bf16
    python -m bench.gpu_selftest --cpu      # the harness itself on the CPU (fp32, gloo);
                                            # the CUDA-only rows say "skip"

Checks (docs/gpu.md says what each protects against):

- packed attention, per kernel (sdpa, eager, flex_attention, flash_attention_2 where it
  runs): one packed micro-batch's logits equal its documents run alone, through pitstop's
  own start-up self-check (train/packcheck.py), bf16 tolerance;
- compile + DDP: `--compile on` compiles the DDP-wrapped module and its fallback is that
  wrapper (never the bare model); compiled and eager gradients agree;
- pinned staging: checkpoint host buffers are pinned, exactly the state's size (tied
  weights once), and hold the device values;
- FSDP2 mixed precision: a bf16 policy runs (bf16 all-gather, fp32 reduce) and its loss
  matches the unsharded autocast loss;
- sizer vs actual peak: the micro-batch sizer's measured peak plus what it reserves for
  the optimizer bounds the peak of a real step (forward, backward, optimizer step).

On a machine without CUDA it prints why nothing ran and exits 0 (tests run that).
Exit code 1 when any check fails.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pitstop.tiny import llama_config

VOCAB = 256
NO_CUDA = "no CUDA device: torch sees none, so no GPU check ran (run this on a GPU machine)"


@dataclass
class Row:
    check: str
    status: str  # pass / FAIL / skip
    detail: str


def _model(attn: str, dev: torch.device, *, seed: int = 0) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = llama_config(VOCAB, layers=2, hidden=128, heads=4, kv_heads=2)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).to(dev)


def _kernels(dev: torch.device) -> list[tuple[str, str | None]]:
    """(kernel, why it cannot run here or None)."""
    from pitstop import probe

    if dev.type != "cuda":
        return [("sdpa", None), ("eager", None), ("flex_attention", "CPU: checked on GPUs only"),
                ("flash_attention_2", "needs a CUDA GPU")]  # fmt: skip
    info, _ = probe.detect_device("cuda")
    flex_ok, flex_why = probe.flex_attention_status(info)
    flash_ok, flash_why = probe.flash_attn_status(info, "bf16")
    return [("sdpa", None), ("eager", None), ("flex_attention", None if flex_ok else flex_why),
            ("flash_attention_2", None if flash_ok else flash_why)]  # fmt: skip


def check_packed(dev: torch.device, precision: str) -> list[Row]:
    from pitstop.train.build import packed_attention_check

    rows = []
    autocast = torch.bfloat16 if precision == "bf16" else None
    for kernel, why_not in _kernels(dev):
        name = f"packed attention: {kernel}"
        if why_not:
            rows.append(Row(name, "skip", why_not))
            continue
        model = _model(kernel, dev)
        check, fallback = packed_attention_check(model, dev, kernel, autocast, precision)
        if fallback is not None:
            rows.append(Row(name, "FAIL", f"did not run: {fallback.reason}"))
            continue
        rows.append(Row(name, "pass" if check.ok else "FAIL", check.summary()))
    return rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _WorldOfOne:
    """A process group of one process (nccl on CUDA, gloo on the CPU) for DDP and FSDP2."""

    def __init__(self, dev: torch.device) -> None:
        self.dev = dev

    def __enter__(self) -> _WorldOfOne:
        import torch.distributed as dist

        backend = "nccl" if self.dev.type == "cuda" else "gloo"
        kw: dict[str, Any] = {}
        if self.dev.type == "cuda":
            torch.cuda.set_device(self.dev)
            kw["device_id"] = self.dev
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1, **kw
        )
        return self

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


def _batch(dev: torch.device, rows: int = 2, width: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (rows, width), generator=g)
    half = width // 2
    pos = torch.cat([torch.arange(half), torch.arange(width - half)]).repeat(rows, 1)
    return {"input_ids": ids.to(dev), "labels": ids.clone().to(dev), "position_ids": pos.to(dev)}


def check_compile_ddp(dev: torch.device, precision: str) -> list[Row]:
    from torch.nn.parallel import DistributedDataParallel

    from pitstop.config import RunConfig
    from pitstop.train import distributed as dist_mod
    from pitstop.train.build import token_loss_sum
    from pitstop.train.compile import GuardedForward, compile_module

    name = "compile + DDP wrapping"
    autocast = torch.bfloat16 if precision == "bf16" else None
    with _WorldOfOne(dev):
        model = _model("sdpa", dev)
        cfg = RunConfig(model="m", data="d", output="o", strategy="ddp")
        env = dist_mod.DistEnv(0, 2, 0, "nccl" if dev.type == "cuda" else "gloo")
        wrapped, _ = dist_mod.wrap(model, cfg, env)
        guard = GuardedForward(wrapped, compile_module(wrapped, 0))
        if not isinstance(guard.eager, DistributedDataParallel):
            return [Row(name, "FAIL", f"fallback is {type(guard.eager).__name__}, not DDP")]
        batch = _batch(dev)
        token_loss_sum(guard, batch, dev.type, autocast).backward()
        if guard.failed:
            return [Row(name, "FAIL", f"compile fell back: {guard.failure}")]
        compiled = [p.grad.detach().clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        token_loss_sum(wrapped, batch, dev.type, autocast).backward()
        worst = max(
            float((a - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-12))
            for a, p in zip(compiled, model.parameters())
        )
    tol = 5e-2 if precision == "bf16" else 1e-3
    ok = worst <= tol and bool(wrapped.gradient_as_bucket_view)
    return [Row(name, "pass" if ok else "FAIL",
                f"compiled the DDP wrapper; fallback is the wrapper; gradients vs eager: largest "
                f"relative difference {worst:.1e} (tolerance {tol:.0e}); bucket views "
                f"{wrapped.gradient_as_bucket_view}")]  # fmt: skip


def check_pinned(dev: torch.device, precision: str) -> list[Row]:
    from pitstop.train import checkpoint as ckpt

    name = "pinned checkpoint staging"
    if dev.type != "cuda":
        return [Row(name, "skip", "pinned memory exists only with CUDA")]
    model = _model("sdpa", dev)
    model.tie_weights()
    state = model.state_dict()
    staging = ckpt.HostStaging()
    out, ready = staging.stage(state)
    ready.synchronize()
    exact = ckpt.state_bytes(state)
    pinned = all(t.is_pinned() for t in out.values())
    same = all(torch.equal(out[k], v.cpu()) for k, v in state.items())
    ok = pinned and same and staging.nbytes == exact
    return [Row(name, "pass" if ok else "FAIL",
                f"{staging.nbytes:,} bytes staged for a {exact:,}-byte state (tied weights "
                f"once); pinned {pinned}; equal to the device values {same}")]  # fmt: skip


def check_fsdp_mp(dev: torch.device, precision: str) -> list[Row]:
    from pitstop.config import RunConfig
    from pitstop.train import distributed as dist_mod
    from pitstop.train.build import token_loss_sum

    name = "FSDP2 mixed precision"
    if precision != "bf16":
        return [Row(name, "skip", "a bf16 policy needs a bf16 run (a GPU)")]
    batch = _batch(dev)
    ref = token_loss_sum(_model("sdpa", dev), batch, dev.type, torch.bfloat16)
    with _WorldOfOne(dev):
        model = _model("sdpa", dev)
        cfg = RunConfig(model="m", data="d", output="o", strategy="fsdp")
        env = dist_mod.DistEnv(0, 2, 0, "nccl")
        wrapped, choice = dist_mod.wrap(model, cfg, env, precision="bf16")
        loss = token_loss_sum(wrapped, batch, dev.type, torch.bfloat16)
        loss.backward()
        grads_fp32 = all(
            p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters()
        )
    rel = float((loss.detach() - ref.detach()).abs() / ref.detach().abs())
    ok = rel <= 2e-2 and grads_fp32 and "bf16 all-gather" in choice.reason
    return [Row(name, "pass" if ok else "FAIL",
                f"loss vs unsharded autocast: relative difference {rel:.1e} (tolerance 2e-2); "
                f"fp32 gradient shards {grads_fp32}")]  # fmt: skip


def check_sizer(dev: torch.device, precision: str) -> list[Row]:
    from pitstop.probe import Choice
    from pitstop.train.build import _cuda_sizer, token_loss_sum
    from pitstop.train.optim import build_optimizer

    name = "sizer vs actual peak"
    if dev.type != "cuda":
        return [Row(name, "skip", "the sizer measures CUDA memory")]
    autocast = torch.bfloat16 if precision == "bf16" else None
    model = _model("sdpa", dev)
    choice = Choice("adamw_fused", "selftest")
    sizer = _cuda_sizer(model, dev, "sdpa", autocast, choice)
    mb = {k: v.cpu() for k, v in _batch(dev, rows=4, width=256).items()}
    measured, _ = sizer.measure(mb)
    predicted = measured + sizer.reserved_bytes
    opt = build_optimizer(model, lr=1e-4, weight_decay=0.0, choice=choice)
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    batch = {k: v.to(dev) for k, v in mb.items()}
    token_loss_sum(model, batch, dev.type, autocast).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    token_loss_sum(model, batch, dev.type, autocast).backward()  # with the moments alive
    torch.cuda.synchronize(dev)
    actual = float(torch.cuda.max_memory_allocated(dev))
    ok = actual <= predicted * 1.05
    return [Row(name, "pass" if ok else "FAIL",
                f"predicted {predicted / 2**20:.1f} MiB (measured {measured / 2**20:.1f} + "
                f"reserved {sizer.reserved_bytes / 2**20:.1f}); actual step peak "
                f"{actual / 2**20:.1f} MiB")]  # fmt: skip


CHECKS: list[Callable[[torch.device, str], list[Row]]] = [
    check_packed, check_compile_ddp, check_pinned, check_fsdp_mp, check_sizer,
]  # fmt: skip


def run_checks(dev: torch.device, precision: str) -> list[Row]:
    rows: list[Row] = []
    for fn in CHECKS:
        t0 = time.perf_counter()
        try:
            got = fn(dev, precision)
        except Exception as e:  # a check that crashes is a failed check, the others still run
            tb = traceback.format_exception_only(type(e), e)[-1].strip()
            got = [Row(fn.__name__.removeprefix("check_"), "FAIL", f"raised {tb}")]
        for r in got:
            r.detail += f" [{time.perf_counter() - t0:.1f} s]"
        rows.extend(got)
    return rows


def table(rows: list[Row]) -> str:
    w = max(len(r.check) for r in rows)
    lines = [f"{'check':<{w}}  result  detail", f"{'-' * w}  ------  ------"]
    lines += [f"{r.check:<{w}}  {r.status:<6}  {r.detail}" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.gpu_selftest", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--cpu", action="store_true", help="run the harness on the CPU (fp32, gloo)")
    args = ap.parse_args(argv)
    if args.cpu:
        dev, precision = torch.device("cpu"), "fp32"
    elif not torch.cuda.is_available():
        print(f"pitstop gpu selftest: {NO_CUDA}")
        return 0
    else:
        dev, precision = torch.device("cuda", torch.cuda.current_device()), "bf16"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (harness dry run)"
    print(f"pitstop gpu selftest on {where}: torch {torch.__version__}, "
          f"transformers {transformers.__version__}, {precision}")  # fmt: skip
    rows = run_checks(dev, precision)
    print(table(rows))
    failed = [r for r in rows if r.status == "FAIL"]
    print(f"{len(rows) - len(failed)} of {len(rows)} passed or skipped; {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
