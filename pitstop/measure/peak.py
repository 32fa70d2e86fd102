"""The device's peak FLOP/s, the denominator of MFU.

GPUs: a table of dense (no structured sparsity) tensor-core peaks from NVIDIA's
datasheets, by precision. CPUs: there is no reliable table, so the peak is
measured once (the best of a few large fp32 matrix products through torch, i.e.
what the BLAS actually reaches with this thread count) and cached in the cache
directory, keyed by CPU model, thread count and torch version.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from pitstop import log
from pitstop.atomic import write_cache_entry
from pitstop.cache_layout import CPU_PEAK
from pitstop.probe import cpu_name

# name fragment -> {precision: dense peak FLOP/s}, with the source of each row.
# Matching is by substring of torch.cuda.get_device_name(), most specific first.
GPU_PEAKS: list[tuple[str, dict[str, float], str]] = [
    ("B200", {"bf16": 2250e12, "fp16": 2250e12, "tf32": 1100e12, "fp32": 75e12},
     "https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200 per GPU, dense = half the sparse figure)"),
    ("H200", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12},
     "https://www.nvidia.com/en-us/data-center/h200/"),
    ("H100 PCIe", {"bf16": 756.5e12, "fp16": 756.5e12, "tf32": 378.0e12, "fp32": 51.2e12},
     "https://www.nvidia.com/en-us/data-center/h100/ (PCIe, dense = half the sparse figure)"),
    ("H100", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12},
     "https://www.nvidia.com/en-us/data-center/h100/ (SXM, dense = half the sparse figure)"),
    ("H20", {"bf16": 148e12, "fp16": 148e12, "tf32": 74e12, "fp32": 44e12},
     "NVIDIA H20 product brief (dense)"),
    ("A100", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
     "https://www.nvidia.com/en-us/data-center/a100/"),
    ("L40S", {"bf16": 362.05e12, "fp16": 362.05e12, "tf32": 183.2e12, "fp32": 91.6e12},
     "https://www.nvidia.com/en-us/data-center/l40s/"),
    ("L40", {"bf16": 181.05e12, "fp16": 181.05e12, "tf32": 90.5e12, "fp32": 90.5e12},
     "https://www.nvidia.com/en-us/data-center/l40/ (dense = half the sparse figure)"),
    ("L4", {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12},
     "https://www.nvidia.com/en-us/data-center/l4/"),
    ("A10", {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12},
     "https://www.nvidia.com/en-us/data-center/products/a10-gpu/"),
    ("RTX 5090", {"bf16": 209.5e12, "fp16": 209.5e12, "tf32": 104.8e12, "fp32": 104.8e12},
     "NVIDIA RTX Blackwell GPU architecture whitepaper, table 1 (fp32 accumulate, dense)"),
    ("RTX 4090", {"bf16": 165.2e12, "fp16": 165.2e12, "tf32": 82.6e12, "fp32": 82.6e12},
     "NVIDIA Ada Lovelace architecture whitepaper, table 2 (fp32 accumulate)"),
    ("RTX 3090", {"bf16": 71e12, "fp16": 71e12, "tf32": 35.6e12, "fp32": 35.6e12},
     "NVIDIA Ampere GA102 whitepaper, table 9 (fp32 accumulate)"),
    ("RTX A6000", {"bf16": 154.8e12, "fp16": 154.8e12, "tf32": 77.4e12, "fp32": 38.7e12},
     "https://www.nvidia.com/en-us/design-visualization/rtx-a6000/ datasheet (dense = half the sparse figure)"),
    ("MI300X", {"bf16": 1307.4e12, "fp16": 1307.4e12, "tf32": 653.7e12, "fp32": 163.4e12},
     "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html (dense)"),
    ("V100", {"fp16": 125e12, "fp32": 15.7e12},
     "https://www.nvidia.com/en-us/data-center/v100/ (SXM2)"),
    ("T4", {"fp16": 65e12, "fp32": 8.1e12},
     "https://www.nvidia.com/en-us/data-center/tesla-t4/"),
]  # fmt: skip


def gpu_peak(name: str, precision: str) -> tuple[float | None, str]:
    """Dense peak FLOP/s of a GPU by name for `precision` (bf16, fp16, tf32, fp32)."""
    # The longest row name found in `name` as a whole word, so "NVIDIA L40" is not the
    # L4 and "H100 PCIe" is not the H100 SXM.
    hits = [
        row
        for row in GPU_PEAKS
        if re.search(r"(?<![a-z0-9])" + re.escape(row[0].lower()) + r"(?![0-9])", name.lower())
    ]
    if hits:
        fragment, peaks, source = max(hits, key=lambda row: len(row[0]))
        if precision in peaks:
            return peaks[precision], f"{fragment} {precision} dense peak, {source}"
        return None, f"{fragment} has no {precision} tensor-core peak in the table"
    return None, f"{name!r} is not in pitstop's GPU peak table; MFU is not reported"


def _cpu_key() -> dict[str, Any]:
    import torch

    return {"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__}


def measure_cpu_peak(size: int = 1024, repeats: int = 5) -> float:
    """Best fp32 FLOP/s of `size`^3 matrix products on this CPU with torch's threads."""
    import torch

    g = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=g)
    b = torch.randn(size, size, generator=g)
    torch.mm(a, b)  # warm-up: thread pool start, page faults
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best


def cpu_peak(cache_dir: str | Path | None) -> tuple[float, str]:
    """The measured CPU fp32 peak, cached under `cache_dir` (measured again if absent)."""
    key = _cpu_key()
    path = Path(cache_dir) / CPU_PEAK if cache_dir else None
    if path is not None and path.is_file():
        try:
            rec = json.loads(path.read_text(encoding="utf-8"))
            if rec.get("key") == key:
                return float(rec["flops"]), f"measured fp32 matmul peak (cached in {path})"
        except (ValueError, KeyError, OSError):
            pass
    # Seconds of silence otherwise, before a first run's first step.
    log.info("pitstop: measuring this CPU's fp32 matmul peak for MFU (once; then cached) ...")
    flops = measure_cpu_peak()
    if path is not None:
        write_cache_entry(path, json.dumps({"key": key, "flops": flops}))
    return flops, "measured fp32 1024x1024 matmul peak on this CPU"


def device_peak(
    dev: Any, precision: str, tf32: bool, cache_dir: str | Path | None
) -> tuple[float | None, str]:
    """Peak FLOP/s for MFU on the device described by a `pitstop.probe.DeviceInfo`."""
    if dev.type == "cpu":
        return cpu_peak(cache_dir)
    prec = precision if precision in ("bf16", "fp16") else ("tf32" if tf32 else "fp32")
    return gpu_peak(dev.name, prec)
