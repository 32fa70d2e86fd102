"""The self-test's speed checks (bench/gpu_selftest.py; docs/gpu.md):

- `check_throughput`: trained tokens/s of `sdpa_docs` against `sdpa` under a dense document
  mask and flash_attention_2 (where it runs) on packed rows of short, medium and long
  documents; informational (a row fails only if a kernel errors);
- `check_matmul`: a large bf16 matmul's achieved TFLOP/s against the GPU peak table
  (pitstop/measure/peak.py) that MFU is computed with.
"""

from __future__ import annotations

from typing import Any

import torch

from bench.gpu_checks_attention import kernels_here
from bench.gpu_checks_util import Row, median_seconds, short_error, sync, tiny_llama

# Rows of 4096 tokens, two per micro-batch, of documents of these lengths (a GPU); the
# CPU's dry run uses a 16th of each, to exercise the harness only.
DOC_LENGTHS = (64, 256, 1024)
ROW_TOKENS = 4096
ROWS = 2
# A small but not tiny Llama: the attention's share of the step is what differs.
GPU_MODEL = {"layers": 4, "hidden": 1024, "heads": 16, "kv_heads": 4, "intermediate": 2816}
CPU_MODEL = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2}
# Achieved / table peak: a healthy card reaches 0.6-0.8 of its dense peak on one large
# matmul; below half (or over the peak) the row is wrong for this card.
PEAK_BAND = (0.5, 1.05)
MATMUL_N = 8192


def _packed(doc_len: int, row_tokens: int, rows: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(doc_len)
    ids = torch.randint(1, 256, (rows, row_tokens), generator=g)
    pos = torch.arange(row_tokens).remainder(doc_len).repeat(rows, 1)
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": pos}


def tokens_per_second(
    model: Any, dev: torch.device, kernel: str, mb: dict[str, torch.Tensor],
    autocast: torch.dtype | None, *, warmup: int, repeats: int,
) -> float:  # fmt: skip
    """Tokens/s of a forward+backward of `model` with `kernel` on host micro-batch `mb`, the
    median of `repeats` timed passes after `warmup` (pitstop's to_device + token_loss_sum)."""
    from pitstop.train.forward import to_device, token_loss_sum
    from pitstop.train.model_io import set_attention

    set_attention(model, kernel)
    batch = to_device(mb, dev, kernel)

    def step() -> None:
        token_loss_sum(model, batch, dev.type, autocast).backward()
        model.zero_grad(set_to_none=True)

    seconds = median_seconds(step, dev, warmup=warmup, repeats=repeats)
    return mb["input_ids"].numel() / seconds


def _rate(tokens_per_s: float) -> str:
    if tokens_per_s >= 1e6:
        return f"{tokens_per_s / 1e6:.2f}M tok/s"
    return f"{tokens_per_s / 1e3:.1f}k tok/s"


def check_throughput(dev: torch.device, precision: str) -> list[Row]:
    gpu = dev.type == "cuda"
    scale = 1 if gpu else 16
    row_tokens = ROW_TOKENS // scale
    autocast = torch.bfloat16 if precision == "bf16" else None
    model = tiny_llama("sdpa", dev, **(GPU_MODEL if gpu else CPU_MODEL))
    kernels = [k for k in kernels_here(dev) if k[0] in ("sdpa_docs", "sdpa", "flash_attention_2")]
    where = "" if gpu else "CPU dry run, a 16th of each length; "
    rows = []
    for doc_len in (n // scale for n in DOC_LENGTHS):
        mb = _packed(doc_len, row_tokens, ROWS)
        rates: dict[str, float] = {}
        notes, failed = [], False
        for kernel, why_not in kernels:
            if why_not:
                notes.append(f"{kernel} skip ({why_not})")
                continue
            try:
                rates[kernel] = tokens_per_second(
                    model,
                    dev,
                    kernel,
                    mb,
                    autocast,
                    warmup=2 if gpu else 1,
                    repeats=5 if gpu else 2,
                )
            except Exception as e:
                failed = True
                notes.append(f"{kernel} raised {short_error(e, 200)}")
        parts = [f"{k} {_rate(v)}" for k, v in rates.items()]
        base = rates.get("sdpa_docs")
        ratios = [
            f"sdpa_docs/{k} {base / v:.2f}x" for k, v in rates.items() if base and k != "sdpa_docs"
        ]
        rows.append(Row(
            f"throughput: {doc_len}-token documents", "FAIL" if failed else "pass",
            f"{where}{ROWS} rows x {row_tokens} tokens, forward+backward, {precision}, median "
            f"of {5 if gpu else 2}: " + "; ".join(parts + ratios + notes)
            + " (sdpa: a dense document mask)",
        ))  # fmt: skip
    return rows


def check_matmul(dev: torch.device, precision: str) -> list[Row]:
    from pitstop.measure.peak import gpu_peak

    name = "bf16 matmul vs peak table"
    if dev.type != "cuda":
        return [Row(name, "skip", "the table holds GPUs (a CPU's peak is measured)")]
    gpu = torch.cuda.get_device_name(dev)
    peak, source = gpu_peak(gpu, "bf16")
    n = MATMUL_N
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
    for _ in range(10):  # warm-up: cuBLAS's heuristics, the clocks ramping up
        torch.mm(a, b, out=c)
    sync(dev)
    times = []
    for _ in range(15):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.mm(a, b, out=c)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return [matmul_row(gpu, 2 * n**3 / times[len(times) // 2], peak, source)]


def matmul_row(gpu: str, achieved: float, peak: float | None, source: str) -> Row:
    """The verdict on `achieved` FLOP/s against the table's `peak` for this card."""
    name = "bf16 matmul vs peak table"
    got = (
        f"{MATMUL_N}^3 bf16 matmul on {gpu}: {achieved / 1e12:.0f} TFLOP/s achieved (median of 15)"
    )
    if peak is None:
        return Row(name, "skip", f"{got}; {source}")
    ratio = achieved / peak
    lo, hi = PEAK_BAND
    ok = lo <= ratio <= hi
    return Row(name, "pass" if ok else "FAIL",
               f"{got}, table peak {peak / 1e12:.0f} TFLOP/s ({ratio:.2f} of it; expected "
               f"{lo}-{hi}): {source}")  # fmt: skip
