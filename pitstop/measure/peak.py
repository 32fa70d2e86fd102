"""The device's peak FLOP/s, the denominator of MFU.

GPUs: the dense (no structured sparsity) tensor-core peaks of the card's entry in the
catalogue (pitstop/catalog/gpus.py), by precision. CPUs: there is no reliable table, so the peak is
measured once per precision (the best of a few 1024^3 matrix products through torch,
fp32 or bf16, i.e. what the BLAS actually reaches with this thread count: tens of
milliseconds) and cached in the cache directory, one file per key (CPU model, thread
count and torch version: pitstop.core.cache_layout.keyed_cache_path).

Also here: the CPU precision measurement `choose_precision` decides with (fp32 against
bf16 autocast, forward+backward of linear layers at the model's own matmul shapes),
measured once per machine and shapes and cached the same way.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypedDict

from pitstop.catalog.gpus import find_spec
from pitstop.catalog.model_config import ModelConfig
from pitstop.core.atomic import write_cache_entry
from pitstop.core.cache_layout import CPU_PEAK, CPU_PEAK_BF16, CPU_PRECISION, keyed_cache_path
from pitstop.measure.cost_model import depth_and_width
from pitstop.measure.flops import mfu as mfu_of
from pitstop.measure.machine import SHARED_CORE_SHARE, cpu_snapshot, other_cpu
from pitstop.probe import PrecisionSpeed, cpu_name


def gpu_peak(name: str, precision: str) -> tuple[float | None, str]:
    """Dense peak FLOP/s of a GPU by name for `precision` (bf16, fp16, tf32, fp32), from the
    card's catalogue entry (pitstop/catalog/gpus.py: `find_spec` reads torch's names)."""
    spec = find_spec(name)
    if spec is None:
        return None, f"{name!r} is not in pitstop's GPU catalogue; MFU is not reported"
    return spec.peak(precision)


class CpuKey(TypedDict):
    """What a CPU measurement depends on: its cache entries are keyed (and checked) by it."""

    cpu: str
    threads: int
    torch: str


def cpu_measurement_key() -> CpuKey:
    import torch

    return CpuKey(cpu=cpu_name(), threads=torch.get_num_threads(), torch=str(torch.__version__))


# The peak is the best of repeated products over at least this long, so a busy moment of the
# machine (another process on a core) shows in the CPU times read around it.
_PEAK_WINDOW_S = 0.25


def measure_cpu_peak(
    size: int = 1024, repeats: int = 3, precision: str = "fp32", min_seconds: float = 0.0
) -> float:
    """Best FLOP/s of `size`^3 matrix products on this CPU with torch's threads, in
    `precision` (fp32, or bf16 inputs with the BLAS's fp32 accumulation): `repeats` timed
    products at least, and more until `min_seconds` have passed."""
    import torch

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    g = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=g).to(dtype)
    b = torch.randn(size, size, generator=g).to(dtype)
    torch.mm(a, b)  # warm-up: thread pool start, page faults, the kernel's first dispatch
    best = float("inf")
    n, start = 0, time.perf_counter()
    while n < repeats or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
        n += 1
    return 2 * size**3 / best


class PeakMeasurement(TypedDict):
    """A measured CPU peak and the machine's load while it was measured."""

    flops: float
    other_cores: float | None  # cores other processes used meanwhile (None: not measurable)
    cores: int | None
    busy: bool  # others held SHARED_CORE_SHARE of the cores or more: the peak reads low


def measure_cpu_peak_quietly(precision: str = "fp32") -> PeakMeasurement:
    """`measure_cpu_peak` over `_PEAK_WINDOW_S`, with the CPU time other processes took."""
    before = cpu_snapshot()
    flops = measure_cpu_peak(precision=precision, min_seconds=_PEAK_WINDOW_S)
    load = other_cpu(before, cpu_snapshot())
    others = load.get("other_cores")
    cores = load.get("machine_cores")
    used = None if others is None else float(others) + float(load.get("steal_cores") or 0.0)
    busy = used is not None and bool(cores) and used >= SHARED_CORE_SHARE * float(cores or 1)
    return PeakMeasurement(flops=flops, other_cores=used, cores=cores, busy=busy)


def read_cached(path: Path | None, key: dict[str, Any]) -> dict[str, Any] | None:
    if path is None or not path.is_file():
        return None
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError):
        return None
    return rec if isinstance(rec, dict) and rec.get("key") == key else None


def cpu_peak(
    cache_dir: str | Path | None, precision: str = "fp32", *, fresh: bool = False
) -> tuple[float, str]:
    """The measured CPU peak in `precision` (fp32 or bf16), cached under `cache_dir`.

    A peak measured while other processes held the cores reads low, and every MFU divided
    by it reads high (a run "faster than its peak"): such a measurement is cached marked
    busy and measured again at the next use, a quiet one replaces it, and of two quiet
    ones the higher is kept. `fresh` measures again whatever the cache holds."""
    precision = "bf16" if precision == "bf16" else "fp32"
    key = cpu_measurement_key()
    name = CPU_PEAK_BF16 if precision == "bf16" else CPU_PEAK
    path = keyed_cache_path(cache_dir, name, key)
    rec = read_cached(path, key)
    cached = rec.get("flops") if rec is not None else None
    cached_ok = isinstance(cached, (int, float)) and cached > 0
    if cached_ok and not rec.get("busy") and not fresh:  # type: ignore[union-attr]
        return float(cached), f"measured {precision} matmul peak (cached in {path})"  # type: ignore[arg-type]
    m = measure_cpu_peak_quietly(precision)
    flops, busy = m["flops"], m["busy"]
    if cached_ok and not rec.get("busy") and float(cached) > flops:  # type: ignore[union-attr, arg-type]
        flops, busy = float(cached), False  # type: ignore[arg-type]
    if path is not None:
        write_cache_entry(
            path,
            json.dumps({"key": key, "flops": flops, "busy": busy, "other_cores": m["other_cores"]}),
        )
    how = f"measured {precision} 1024x1024 matmul peak on this CPU"
    if busy:
        how += (
            f" while other processes used {m['other_cores']:.1f} of {m['cores']} cores "
            "(it reads low; measured again at the next run)"
        )
    return flops, how


# The precision measurement's budget: FLOPs of one forward+backward over all shapes
# (~20 ms in fp32 at 200 GFLOP/s), so measuring both precisions a few times stays well
# under a second on any model size.
_PRECISION_FLOPS_BUDGET = 4.0e9
_PRECISION_REPEATS = 3
_PRECISION_SAMPLE_S = 0.01  # each timed sample lasts at least this long


def model_matmul_shapes(
    model_config: ModelConfig | Mapping[str, Any] | None, tokens: int
) -> tuple[tuple[int, int, int], ...]:
    """(tokens, in, out) of a decoder's main matmuls, from its config.json: the MLP's
    up projection and the LM head. Each dimension is capped at 2048 (the BLAS's speed ratio
    between precisions has settled by then) and `tokens` is scaled down, so one
    forward+backward of all of them stays within _PRECISION_FLOPS_BUDGET."""
    if not isinstance(model_config, ModelConfig):
        model_config = ModelConfig.from_mapping(model_config or {})
    # Defaults for a config without the sizes: a small decoder's, measured all the same.
    d = model_config.hidden_size or 256
    ffn = model_config.intermediate_size or 4 * d
    vocab = model_config.vocab_size or 32000
    dims = [(min(d, 2048), min(ffn, 2048)), (min(d, 2048), min(vocab, 2048))]
    per_token = sum(6 * k * n for k, n in dims)
    m = max(64, min(int(tokens), int(_PRECISION_FLOPS_BUDGET // per_token)))
    return tuple((m, k, n) for k, n in dims)


def module_shapes(model: Any) -> dict[str, int] | None:
    """{"hidden_size", "intermediate_size", "vocab_size", "num_hidden_layers"} of a model
    read off its linear layers (any nn.Module, not only a Hugging Face one): the widest output is the LM head
    (its input the width), the widest other output from that width the MLP's up projection.
    None for a model without linear layers."""
    import torch

    linears = [
        (m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)
    ]
    if not linears:
        return None
    width, vocab = max(linears, key=lambda io: io[1])
    ffn = max((o for i, o in linears if i == width and o != vocab), default=4 * width)
    layers, _ = depth_and_width(model)
    out = {"hidden_size": int(width), "intermediate_size": int(ffn), "vocab_size": int(vocab)}
    if layers:
        out["num_hidden_layers"] = int(layers)
    return out


def measure_precision_speed(shapes: tuple[tuple[int, int, int], ...]) -> tuple[float, float]:
    """(fp32 seconds, bf16-autocast seconds): the fastest of a few forward+backward passes of
    linear layers at `shapes`, as a training step runs them (fp32 weights; autocast casts)."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    layers = [
        (torch.randn(m, k, generator=g), torch.randn(n, k, generator=g).requires_grad_())
        for m, k, n in shapes
    ]

    def passes(bf16: bool, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                outs = [F.linear(x.requires_grad_(), w) for x, w in layers]
            sum(o.float().sum() for o in outs).backward()
            for x, w in layers:
                x.grad = w.grad = None
        return (time.perf_counter() - t0) / n

    passes(False, 1), passes(True, 1)  # warm-up: thread pool, the bf16 kernels' first dispatch
    # A small model's pass takes well under a millisecond, where one timing is mostly
    # noise: each sample averages enough passes to last _PRECISION_SAMPLE_S.
    n = max(1, min(1000, math.ceil(_PRECISION_SAMPLE_S / max(passes(False, 1), 1e-6))))
    best = {False: float("inf"), True: float("inf")}
    for _ in range(_PRECISION_REPEATS):  # interleaved, so a busy moment hits both
        for bf16 in (False, True):
            best[bf16] = min(best[bf16], passes(bf16, n))
    return best[False], best[True]


def cpu_precision_speed(
    cache_dir: str | Path | None, shapes: tuple[tuple[int, int, int], ...]
) -> PrecisionSpeed:
    """fp32 against bf16 autocast at `shapes` on this CPU, measured once and cached."""
    key = {**cpu_measurement_key(), "shapes": [list(s) for s in shapes]}
    path = keyed_cache_path(cache_dir, CPU_PRECISION, key)
    rec = read_cached(path, key)
    if rec is not None:
        try:
            return PrecisionSpeed(
                float(rec["fp32_s"]), float(rec["bf16_s"]), shapes, f"reused (cached in {path})"
            )
        except (KeyError, TypeError, ValueError):
            pass
    fp32_s, bf16_s = measure_precision_speed(shapes)
    if path is not None:
        write_cache_entry(path, json.dumps({"key": key, "fp32_s": fp32_s, "bf16_s": bf16_s}))
    return PrecisionSpeed(fp32_s, bf16_s, shapes, "measured on this CPU")


def model_precision_speed(
    cache_dir: str | Path | None, model_dir: str | Path, max_seq_len: int
) -> PrecisionSpeed:
    """`cpu_precision_speed` at the matmul shapes of the model in `model_dir` (its
    config.json) for rows of `max_seq_len`: what `pitstop train` decides `--precision auto`
    with on a CPU, and what the doctor reads (the same cache entry, so neither measures twice).
    An unreadable config.json measures default shapes: the model's own loading reports it."""
    model_config = ModelConfig.read_optional(model_dir)
    return cpu_precision_speed(cache_dir, model_matmul_shapes(model_config, max_seq_len))


def profile_precision_speed(
    cache_dir: str | Path | None, profile: Mapping[str, Any]
) -> PrecisionSpeed | None:
    """fp32 against bf16 autocast at the matmul shapes of a profiled run's model (its
    "model_shapes", rows of its mean computed length): what the precision finding predicts
    a profiled fp32 run's bf16 gain from, the measurement `pitstop train` decides with.
    None when the profile does not hold the shapes."""
    shapes = profile.get("model_shapes")
    if not isinstance(shapes, Mapping) or not shapes.get("hidden_size"):
        return None
    positions = profile.get("padded_tokens")
    steps = max(1, int(profile.get("steps") or 1))
    rows = (profile.get("config") or {}).get("per_device_train_batch_size") or 1
    accum = (profile.get("config") or {}).get("gradient_accumulation_steps") or 1
    tokens = 512
    if isinstance(positions, (int, float)) and positions > 0:
        tokens = max(1, round(positions / (steps * max(1, int(rows)) * max(1, int(accum)))))
    cfg = ModelConfig.from_mapping(dict(shapes))
    return cpu_precision_speed(cache_dir, model_matmul_shapes(cfg, tokens))


def device_peak(
    dev: Any, precision: str, tf32: bool, cache_dir: str | Path | None, *, fresh: bool = False
) -> tuple[float | None, str]:
    """Peak FLOP/s for MFU on the device described by a `pitstop.probe.DeviceInfo`
    (`fresh`: a CPU's peak measured again, not read from the cache)."""
    if dev.type == "cpu":
        return cpu_peak(cache_dir, precision, fresh=fresh)
    prec = precision if precision in ("bf16", "fp16") else ("tf32" if tf32 else "fp32")
    return gpu_peak(dev.name, prec)


class TrustedMfu(TypedDict):
    """An MFU that can be true, the peak behind it, and why it is missing when it is."""

    mfu: float | None
    peak_flops: float | None
    peak_source: str
    note: str | None  # set when the MFU is withheld or the peak was measured again


def trusted_mfu(
    positions_per_second: float,
    flops_per_token: float,
    dev: Any,
    precision: str,
    tf32: bool,
    cache_dir: str | Path | None,
) -> TrustedMfu:
    """MFU against the device's peak, never above 100%.

    A run cannot compute faster than its device's peak: an MFU over 1 means the peak is
    wrong (a CPU peak measured while the machine was busy). The CPU peak is then measured
    again; if the run still beats it, no MFU is reported and the note says why. A GPU's
    peak comes from the catalogue: beating it withholds the MFU the same way."""
    try:
        peak, source = device_peak(dev, precision, tf32, cache_dir)
    except Exception as e:  # a peak that cannot be measured here: no MFU, and why
        return TrustedMfu(mfu=None, peak_flops=None, peak_source=str(e), note=None)
    value = mfu_of(positions_per_second, flops_per_token, peak)
    note = None
    if value is not None and value > 1.0 and dev.type == "cpu":
        first = peak
        peak, source = device_peak(dev, precision, tf32, cache_dir, fresh=True)
        value = mfu_of(positions_per_second, flops_per_token, peak)
        note = (
            f"the cached {precision} peak ({(first or 0) / 1e9:.0f} GFLOP/s) was below what "
            f"this run computed; measured again: {(peak or 0) / 1e9:.0f} GFLOP/s"
        )
    if value is not None and value > 1.0:
        achieved = positions_per_second * flops_per_token
        note = (
            f"MFU not reported: the run computed {achieved / 1e9:.0f} GFLOP/s, above the "
            f"device's peak of {(peak or 0) / 1e9:.0f} GFLOP/s ({source}); the peak is suspect"
        )
        value = None
    return TrustedMfu(mfu=value, peak_flops=peak, peak_source=source, note=note)
