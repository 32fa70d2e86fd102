"""Attention benchmark: sdpa vs flex_attention vs flash_attention_2 on packed multi-row micro-batches.

    python -m bench.attention --gpu               # the 1.1B bench Llama, bf16, 4/8/16 rows of 1024
    python -m bench.attention --cpu-smoke         # a tiny Llama on the CPU: the plumbing only
    python -m bench.attention                     # --gpu where torch sees a GPU, else the smoke

Each backend gets the same model (same seed, built on the device), the same packed
micro-batch and pitstop's own forward (`to_device` + `token_loss_sum`, so flash-attn gets
the varlen kwargs pitstop passes): documents with lognormal lengths (seeded), packed
best-fit-decreasing into rows of max length, collated by pitstop's collate. A timed
iteration is forward + backward of the micro-batch (bf16 autocast, fp32 weights, as
pitstop trains); the table reports the median of `--repeats` after `--warmup` untimed
ones, the first call's seconds (flex compiles its kernel there), peak memory, and the
loss's relative difference from sdpa's on the same batch (a correctness check: packed
documents must not see each other on any backend). On the CPU FlexAttention has no
backward (torch 2.13), so flex is timed forward only there and says so.

`--gpu` writes bench/results/attention-gpu.md with the GPU, driver and versions.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import fmt, markdown_table, median, write_result
from pitstop import probe
from pitstop.batching.collate import collate
from pitstop.batching.plan import MicroBatchSpec
from pitstop.core.packing import best_fit_decreasing
from pitstop.tiny import llama_config
from pitstop.train.forward import to_device, token_loss_sum

BACKENDS = ("sdpa", "flex_attention", "flash_attention_2", "eager")


@dataclass(frozen=True)
class Sizes:
    layers: int
    hidden: int
    heads: int
    vocab: int
    max_len: int
    rows: tuple[int, ...]
    repeats: int
    warmup: int


# The headline benchmark's GPU model: Llama 16 x 2048, 16 heads, 8k vocabulary (1.1B).
GPU = Sizes(layers=16, hidden=2048, heads=16, vocab=8192, max_len=1024, rows=(4, 8, 16),
            repeats=10, warmup=3)  # fmt: skip
CPU_SMOKE = Sizes(layers=2, hidden=64, heads=4, vocab=256, max_len=64, rows=(2,),
                  repeats=2, warmup=1)  # fmt: skip


def packed_micro_batch(rows: int, max_len: int, vocab: int, seed: int) -> dict[str, Any]:
    """`rows` packed rows of `max_len`, as pitstop's loader builds them (collate)."""
    rng = np.random.default_rng(seed)
    # Median ~0.45 x max length with a long tail (the KJV chapters' shape at 1024), clipped.
    n_docs = rows * 8
    lens = np.clip(rng.lognormal(np.log(0.45 * max_len), 0.6, n_docs), 8, max_len).astype(np.int64)
    bins = best_fit_decreasing(lens, max_len)
    # A random draw of the packed rows (as a step's micro-batch is), not the fullest ones:
    # those are mostly single documents cut at max length, which would not test packing.
    chosen = [bins[i] for i in rng.permutation(len(bins))[:rows]]
    ids = np.arange(len(lens))
    offsets = np.concatenate([[0], np.cumsum(lens)])
    tokens = rng.integers(3, vocab, int(offsets[-1]))
    mask = np.ones(len(tokens), np.uint8)
    spec = MicroBatchSpec(tuple(ids[np.asarray(b)] for b in chosen), max_len)
    return collate(tokens, mask, offsets, spec, pad_id=2)


def runnable(attn: str, dev: probe.DeviceInfo, precision: str) -> tuple[bool, str]:
    if attn == "flash_attention_2":
        return probe.flash_attn_status(dev, precision)
    if attn == "flex_attention":
        ok, why = probe.flex_attention_status(dev)
        if not ok and dev.type == "cpu" and "no backward" in why:
            return True, "forward only: " + why  # the forward still runs: time it
        return ok, why
    return True, ""


def build_model(sizes: Sizes, attn: str, device: torch.device, seed: int) -> Any:
    from transformers import AutoModelForCausalLM

    cfg = llama_config(
        sizes.vocab, layers=sizes.layers, hidden=sizes.hidden, heads=sizes.heads,
        max_positions=max(4096, sizes.max_len),
    )  # fmt: skip
    torch.manual_seed(seed)
    with device:  # initialise on the device: a 1.1B model in seconds, not a CPU minute
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    model.train()
    return model


def time_backend(
    model: Any, attn: str, mb: dict[str, Any], device: torch.device, sizes: Sizes, *, backward: bool
) -> dict[str, Any]:
    """Median seconds per forward(+backward), first-call seconds, peak memory, loss."""
    cuda = device.type == "cuda"
    autocast = torch.bfloat16 if cuda else None

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    batch = to_device(mb, device, attn)
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    def once() -> float:
        with torch.set_grad_enabled(backward):
            loss = token_loss_sum(model, batch, device.type, autocast)
            if backward:
                loss.backward()
                model.zero_grad(set_to_none=True)
        return float(loss.detach())

    t0 = time.perf_counter()
    loss = once()  # the first call of a shape: flex compiles its kernel and block mask here
    sync()
    first = time.perf_counter() - t0
    for _ in range(sizes.warmup - 1):
        once()
    times = []
    for _ in range(sizes.repeats):
        sync()
        t = time.perf_counter()
        once()
        sync()
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated() if cuda else None
    return {"seconds": median(times), "first_s": first, "peak_bytes": peak, "loss": loss}


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(sizes: Sizes, device: torch.device, backends: list[str], seed: int) -> list[list[Any]]:
    """One table row per (micro-batch, backend); each backend's model is built once."""
    if device.type == "cuda":
        dev, _ = probe.detect_device("cuda")
        precision = "bf16"
        x = torch.ones(256, 256, device=device)
        (x @ x).sum().item()  # CUDA context and cuBLAS start before the first timed backend
    else:
        dev, precision = probe.detect_device("cpu")[0], "fp32"
    mbs = {rows: packed_micro_batch(rows, sizes.max_len, sizes.vocab, seed) for rows in sizes.rows}
    results: dict[tuple[int, str], Any] = {}
    for attn in backends:
        ok, why = runnable(attn, dev, precision)
        if not ok:
            results.update({(rows, attn): f"skipped: {why}" for rows in sizes.rows})
            continue
        backward = not why.startswith("forward only")
        model = build_model(sizes, attn, device, seed)
        for rows in sizes.rows:
            if attn == "flex_attention":
                # Each shape compiles from scratch, as one run's fixed micro-batch shape does:
                # dynamo's dynamic-shape recompile of a second shape fails to build FlexAttention's
                # CPU kernel in torch 2.13 (a C++ compile error), and the timing of a first call
                # should not depend on which shape came before.
                torch._dynamo.reset()
            try:
                r = time_backend(model, attn, mbs[rows], device, sizes, backward=backward)
                results[rows, attn] = {**r, "pass": "fwd+bwd" if backward else "fwd only"}
            except torch.cuda.OutOfMemoryError:
                results[rows, attn] = "out of memory"
            free(device)
            print(f"{attn}, {rows} rows: {results[rows, attn]}", flush=True)
        del model
        free(device)
    table = []
    for rows in sizes.rows:
        mb = mbs[rows]
        seen = int((mb["input_ids"] != 2).sum())
        n_docs = len(mb["cu_seqlens"]) - 1
        shape = (
            f"{rows} x {sizes.max_len}, {n_docs} docs, {seen / mb['input_ids'].numel():.0%} real"
        )
        ref = results.get((rows, "sdpa"))
        for attn in backends:
            r = results[rows, attn]
            if isinstance(r, str):
                table.append([shape, attn, "—", "—", "—", "—", "—", r])
                continue
            if attn == "sdpa":
                vs_sdpa = "reference"
            elif isinstance(ref, dict):
                vs_sdpa = fmt(abs(r["loss"] - ref["loss"]) / abs(ref["loss"]), ".1e")
            else:
                vs_sdpa = "n/a"
            table.append([
                shape, attn, r["pass"], fmt(r["seconds"] * 1e3, ",.1f"),
                fmt(seen / r["seconds"], ",.0f"), fmt(r["first_s"], ".1f"),
                fmt(r["peak_bytes"] / 2**30 if r["peak_bytes"] else None, ".1f"), vs_sdpa,
            ])  # fmt: skip
    return table


HEADERS = [
    "micro-batch", "attention", "pass", "median ms", "tokens/s (real)", "first call s",
    "peak GiB", "loss vs sdpa (rel)",
]  # fmt: skip


def gpu_description() -> str:
    """The GPU, its driver and CUDA, for the results file."""
    if not torch.cuda.is_available():
        return "no GPU"
    name = torch.cuda.get_device_name(0)
    driver = "?"
    try:
        import pynvml

        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
    except Exception:  # nvidia-ml-py is optional: the driver is then unnamed
        pass
    return f"{name}, driver {driver}, CUDA {torch.version.cuda}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--gpu", action="store_true", help="the 1.1B bench Llama on the GPU, bf16")
    mode.add_argument("--cpu-smoke", action="store_true", help="a tiny Llama on the CPU")
    ap.add_argument("--rows", help="comma-separated rows per micro-batch (default 4,8,16 on GPU)")
    ap.add_argument("--max-len", type=int, help="positions per row (default 1024 on GPU)")
    ap.add_argument("--repeats", type=int, help="timed iterations per backend")
    ap.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="results file (default with --gpu: "
                    "bench/results/attention-gpu.md; the smoke writes none unless given)")  # fmt: skip
    args = ap.parse_args(argv)
    if not (args.gpu or args.cpu_smoke):  # `make bench` runs every benchmark without flags
        args.gpu = torch.cuda.is_available()
    sizes = GPU if args.gpu else CPU_SMOKE
    over: dict[str, Any] = {}
    if args.rows:
        over["rows"] = tuple(int(x) for x in args.rows.split(","))
    if args.max_len:
        over["max_len"] = args.max_len
    if args.repeats:
        over["repeats"] = args.repeats
    sizes = dataclasses.replace(sizes, **over)
    if args.gpu and not torch.cuda.is_available():
        ap.error("--gpu needs a CUDA device and torch sees none; use --cpu-smoke")
    device = torch.device("cuda" if args.gpu else "cpu")
    if not args.gpu:
        torch.set_num_threads(1)  # a tiny model gains nothing from threads on a shared box
    backends = [b for b in args.backends.split(",") if b]
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown:
        ap.error(f"unknown --backends {unknown}; choose from {', '.join(BACKENDS)}")
    table = run(sizes, device, backends, args.seed)
    body = markdown_table(HEADERS, table)
    print(body)
    out = args.out or (Path(__file__).parent / "results" / "attention-gpu.md" if args.gpu else None)
    if out is not None:
        model = f"Llama {sizes.layers} x {sizes.hidden}, {sizes.heads} heads, vocab {sizes.vocab}"
        notes = (
            f"- device: {gpu_description() if args.gpu else 'CPU'}\n"
            f"- model: {model}, random init; "
            + ("bf16 autocast, fp32 weights" if args.gpu else "fp32")
            + f"; median of {sizes.repeats} after {sizes.warmup} warm-up\n"
            "- peak memory: fp32 weights and gradients plus activations (no optimizer state)\n"
            "- tokens/s counts real (non-padding) positions; a row's documents are packed "
            "best-fit-decreasing from lognormal lengths (seed "
            f"{args.seed})\n\n"
        )
        write_result("attention-gpu" if args.gpu else "attention-smoke",
                     "Attention kernels on packed multi-row micro-batches", notes + body,
                     path=out)  # fmt: skip
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
