"""Device and kernel decisions, made in one place, each with the reason it was made.

Every run-time choice that depends on the machine (device, precision, TF32,
attention kernel, torch.compile) is decided here once, at start-up, and printed
in the run banner. Each decision is a pure function of the requested setting
and a `DeviceInfo`, so tests override the machine by passing their own
`DeviceInfo` (e.g. a pretend V100 to check the fp16 + GradScaler path) instead
of patching torch.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypedDict

from pitstop.core import host_malloc, run_files, run_record, runlock
from pitstop.core.config import RunConfig
from pitstop.core.errors import ConfigError
from pitstop.core.versions import parse_version

# torch.compile cost/benefit basis, before a configuration is measured: the same 7.6M-parameter
# Llama (4 layers of 256, 8k vocabulary) in bf16 autocast on the 2-core development CPU, 4 x
# 512 tokens a step, took 37 s to compile on a cold inductor cache (14 s warm) and then ran
# its steps 1.27x faster (issue 46). The basis rounds both toward not compiling. Without a
# measurement of the user's configuration, `--compile auto` compiles only when that gain
# would repay the compile time COMPILE_PAYBACK times over; a run that compiles measures both
# (train/compile_record.py), and later runs decide with that measurement (`_measured_payoff`).
# bench/compile_payoff.py measures them on the headline model.
COMPILE_SECONDS_BASIS = 40.0
COMPILE_GAIN_BASIS = 1.2
COMPILE_PAYBACK = 3.0  # the estimated saving must exceed the compile time this many times
# With this configuration's own measurements, two questions. Is a compiled step faster at
# all? Only if its paired steps show a gain above 1x with COMPILE_GAIN_CONFIDENCE (a lower
# bound on their median): a median gain within a busy machine's noise is no gain. Then, does
# it pay? The median gain's saving over the planned steps (the expected saving) must exceed
# the measured compile, a cold one (a warm inductor cache makes the next compile cheaper).
# On the 2-core CPU the headline model's two long runs (bench/results/compile_payoff.md)
# had bounds of 1.01-1.04x: compiling saved -1 s and +23 s on ~550-650 s train clocks.
COMPILE_GAIN_CONFIDENCE = 0.9
# Used only to estimate a run's length before it starts (for `--compile auto`).
ASSUMED_MFU_FOR_ESTIMATE = 0.3


@dataclass(frozen=True)
class Choice:
    """One decision and why it was made (`measured`: the measurement it rests on, if any)."""

    value: Any
    reason: str
    measured: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"value": self.value, "reason": self.reason}
        if self.measured is not None:
            d["measured"] = self.measured
        return d


@dataclass(frozen=True)
class DeviceInfo:
    """What the probe found about the device; tests construct one to pretend."""

    type: str  # "cuda" or "cpu"
    name: str
    capability: tuple[int, int] | None = None  # CUDA compute capability
    bf16: bool = False  # bf16 matmuls supported natively
    total_memory_bytes: int | None = None
    cpu_count: int = 1
    index: int = 0

    @property
    def torch_device(self) -> str:
        return f"cuda:{self.index}" if self.type == "cuda" else "cpu"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def cpu_name() -> str:
    """The CPU model name (from /proc/cpuinfo where available)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "cpu"


# CPU flags (Linux /proc/cpuinfo names) of native bf16 matrix instructions: AVX-512 BF16
# (dot products) and AMX (tile matrix multiply). Without either, CPU bf16 is emulated.
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (from /proc/cpuinfo; empty where it does not exist), plus any
    a test adds (pitstop.core.faults: the test variable CPU_FLAGS)."""
    from pitstop.core.faults import from_env

    extra = from_env().cpu_flags
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split()) | extra
    except OSError:
        pass
    return extra


def cpu_has_bf16(flags: frozenset[str] | None = None) -> bool:
    """Whether the CPU computes bf16 natively (CPU_BF16_FLAGS; `flags` defaults to this CPU's)."""
    flags = cpu_flags() if flags is None else flags
    return any(f in flags for f in CPU_BF16_FLAGS)


def detect_device(requested: str = "auto", *, index: int = 0) -> tuple[DeviceInfo, Choice]:
    """Find the device to train on; `requested` is cfg.device (auto, cpu, cuda)."""
    import torch

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    has_cuda = torch.cuda.is_available()
    if requested == "cuda" and not has_cuda:
        raise ConfigError(no_cuda_problem())
    if requested == "cpu" or not has_cuda:
        why = (
            "asked for with --device cpu"
            if requested == "cpu"
            else "no CUDA device visible to torch"
        )
        info = DeviceInfo(type="cpu", name=cpu_name(), bf16=cpu_has_bf16(), cpu_count=cpus)
        return info, Choice("cpu", why)
    props = torch.cuda.get_device_properties(index)
    cap = (props.major, props.minor)
    info = DeviceInfo(
        type="cuda",
        name=props.name,
        capability=cap,
        bf16=bool(torch.cuda.is_bf16_supported()) and cap >= (8, 0),
        total_memory_bytes=int(props.total_memory),
        cpu_count=cpus,
        index=index,
    )
    why = "asked for with --device cuda" if requested == "cuda" else "a CUDA device is visible"
    return info, Choice(
        f"cuda:{index}", f"{why}: {props.name}, compute capability {cap[0]}.{cap[1]}"
    )


def no_cuda_problem() -> str:
    import torch

    return (
        "--device cuda was asked for, but torch sees no CUDA device "
        f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); "
        "use --device cpu or install a CUDA build of torch"
    )


def precision_problem(requested: str, dev: DeviceInfo) -> str | None:
    """Why `--precision requested` cannot run on `dev`, or None."""
    if dev.type == "cpu" and requested == "fp16":
        return (
            "--precision fp16 needs a CUDA GPU; this run is on the CPU, where pitstop trains "
            "in fp32 or, on a CPU with native bf16, bf16 autocast; use --precision fp32 or auto"
        )
    if dev.type == "cpu" and requested == "bf16" and not dev.bf16:
        return (
            f"--precision bf16 needs a CUDA GPU or a CPU with native bf16 instructions "
            f"({' or '.join(CPU_BF16_FLAGS)} in its flags); {dev.name} has neither, so bf16 "
            "would be emulated and slower than fp32; use --precision fp32 or auto"
        )
    if dev.type == "cuda" and requested == "bf16" and not dev.bf16:
        return (
            f"--precision bf16: {dev.name} (compute capability {dev.capability}) has no bf16 "
            "support; use --precision fp16 (with loss scaling) or auto"
        )
    return None


# bf16 autocast on the CPU is chosen only when it measured at least this much faster than
# fp32 at the model's shapes. A small gain is not worth bf16's rounding, and it is not a
# stable answer: on the 2-core dev box a width-64 model's shapes measured 1.06-1.25x from
# one measurement to the next (a width-256 model's, 1.96-2.04x), so a threshold near 1.1
# would flip a small model's precision between two machines' caches.
CPU_BF16_MIN_GAIN = 1.3


@dataclass(frozen=True)
class PrecisionSpeed:
    """A timing of fp32 against bf16 autocast on this CPU (pitstop.measure.peak measures it).

    `fp32_s` / `bf16_s`: the fastest forward+backward of linear layers at `shapes`
    ((tokens, in, out) each), the model's matmuls; `source` says measured or cached.
    """

    fp32_s: float
    bf16_s: float
    shapes: tuple[tuple[int, int, int], ...]
    source: str

    @property
    def gain(self) -> float:
        return self.fp32_s / self.bf16_s if self.bf16_s > 0 else 0.0

    def describe(self) -> str:
        dims = ", ".join("x".join(str(d) for d in shape) for shape in self.shapes)
        return (
            f"{self.source}: linear forward+backward at the model's shapes ({dims}) took "
            f"{self.fp32_s * 1e3:.1f} ms in fp32 and {self.bf16_s * 1e3:.1f} ms under bf16 "
            f"autocast ({self.gain:.2f}x)"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "fp32_seconds": self.fp32_s,
            "bf16_seconds": self.bf16_s,
            "bf16_speedup": round(self.gain, 4),
            "shapes": [list(s) for s in self.shapes],
            "source": self.source,
        }


def cpu_bf16_candidate(requested: str, dev: DeviceInfo) -> bool:
    """Whether `choose_precision` would weigh bf16 on this CPU (so it is worth measuring)."""
    return dev.type == "cpu" and requested == "auto" and dev.bf16


def choose_precision(
    requested: str, dev: DeviceInfo, measured: PrecisionSpeed | None = None
) -> Choice:
    """bf16 autocast where the GPU has it, fp16 + GradScaler on older GPUs; on a CPU, bf16
    autocast where the CPU has native bf16 and `measured` says it is faster, else fp32.

    bf16 autocast keeps fp32 master weights, an fp32 loss and fp32 optimizer state.
    """
    problem = precision_problem(requested, dev)
    if problem:
        raise ConfigError(problem)
    if dev.type == "cpu":
        return _choose_cpu_precision(requested, dev, measured)
    if requested == "bf16":
        return Choice("bf16", "asked for; the GPU supports bf16")
    if requested == "fp16":
        return Choice("fp16", "asked for; trained with fp16 autocast and a GradScaler")
    if requested == "fp32":
        return Choice("fp32", "asked for (matmuls use TF32 where the GPU has it)")
    if dev.bf16:
        return Choice("bf16", f"{dev.name} supports bf16: autocast with fp32 master weights")
    return Choice(
        "fp16",
        f"{dev.name} (compute capability {dev.capability}) has no bf16: "
        "fp16 autocast with a GradScaler",
    )


def _choose_cpu_precision(
    requested: str, dev: DeviceInfo, measured: PrecisionSpeed | None
) -> Choice:
    if requested == "fp32":
        return Choice("fp32", "asked for")
    if requested == "bf16":
        return Choice(
            "bf16",
            "asked for; the CPU has native bf16: autocast with fp32 master weights, "
            "fp32 loss and optimizer state",
        )
    if not dev.bf16:
        return Choice(
            "fp32",
            f"CPU without native bf16 ({' / '.join(CPU_BF16_FLAGS)} not in its flags): "
            "bf16 would be emulated, slower than fp32",
        )
    if measured is None:
        return Choice("fp32", "the CPU has native bf16, but its speed was not measured here")
    if measured.gain >= CPU_BF16_MIN_GAIN:
        return Choice(
            "bf16",
            f"CPU with native bf16, measured faster: {measured.describe()}; autocast with "
            "fp32 master weights, fp32 loss and optimizer state (--precision fp32 to opt out)",
            measured.to_dict(),
        )
    return Choice(
        "fp32",
        f"CPU with native bf16, but not measured {CPU_BF16_MIN_GAIN:.2f}x faster: "
        f"{measured.describe()}",
        measured.to_dict(),
    )


def choose_tf32(dev: DeviceInfo, precision: str) -> Choice:
    """TF32 for fp32 matmuls on Ampere+ GPUs; it changes nothing on CPU."""
    if dev.type != "cuda":
        return Choice(False, "CPU: TF32 does not exist here")
    if dev.capability is None or dev.capability < (8, 0):
        return Choice(False, f"compute capability {dev.capability} has no TF32 tensor cores")
    return Choice(
        True,
        "Ampere or newer: fp32 matmuls"
        + (" (the optimizer and anything outside autocast)" if precision != "fp32" else "")
        + " use TF32 tensor cores (10-bit mantissa inputs, fp32 accumulate)",
    )


def flash_attn_status(dev: DeviceInfo, precision: str) -> tuple[bool, str]:
    """Whether flash_attention_2 can run here, and why not when it cannot."""
    if dev.type != "cuda":
        return False, "flash-attn needs a CUDA GPU"
    if dev.capability is None or dev.capability < (8, 0):
        return False, f"flash-attn 2 needs compute capability 8.0+, this GPU has {dev.capability}"
    if precision not in ("bf16", "fp16"):
        return False, "flash-attn runs in bf16/fp16 only and this run is fp32"
    if importlib.util.find_spec("flash_attn") is None:
        return False, "the flash_attn package is not installed (pip install flash-attn)"
    return True, "flash_attn is installed and the GPU supports it"


def flex_attention_status(dev: DeviceInfo) -> tuple[bool, str]:
    """Whether FlexAttention can train here (forward and backward), and why not when it cannot."""
    import torch

    if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
        return False, f"torch {torch.__version__} has no FlexAttention (torch >= 2.5 has)"
    if dev.type != "cuda":
        # Its forward runs on the CPU, but the backward raises NotImplementedError
        # (torch 2.13), and training needs the backward.
        return (
            False,
            f"FlexAttention has no backward on the {dev.type.upper()} (torch {torch.__version__})",
        )
    return True, "FlexAttention is available on this GPU"


def attention_problem(requested: str, dev: DeviceInfo, precision: str) -> str | None:
    """Why `--attention requested` cannot run on `dev` at `precision`, or None."""
    if requested == "flash_attention_2":
        ok, why = flash_attn_status(dev, precision)
    elif requested == "flex_attention":
        ok, why = flex_attention_status(dev)
    else:
        return None
    return None if ok else f"--attention {requested} is not possible: {why}; use sdpa or auto"


def four_bit_problem(dev: DeviceInfo) -> str | None:
    """Why 4-bit weights cannot be used on `dev`, or None: bitsandbytes has 4-bit kernels
    for CUDA, and for the CPU since 0.45."""
    try:
        import bitsandbytes
    except ImportError:
        return "--load-in-4bit needs bitsandbytes: pip install 'bitsandbytes>=0.45'"
    except Exception as e:  # a broken native library raises RuntimeError and kin at import
        return f"--load-in-4bit: bitsandbytes does not load here ({type(e).__name__}: {e})"
    if dev.type == "cpu":
        version = tuple(int(x) for x in re.findall(r"\d+", bitsandbytes.__version__)[:2])
        if version < (0, 45):
            return (
                f"--load-in-4bit on the CPU needs bitsandbytes >= 0.45 (its CPU backend), found "
                f"{bitsandbytes.__version__}: pip install -U 'bitsandbytes>=0.45'"
            )
    elif dev.type != "cuda":
        return f"--load-in-4bit: bitsandbytes has no 4-bit kernels for {dev.type}"
    return None


def output_dir_problem(output: str | None, *, resume: bool, overwrite: bool) -> str | None:
    """Why `--output` cannot be written to as asked (a file, another run without
    --resume/--overwrite, or a user's files at names the run writes without --overwrite),
    or None. Reads only."""
    if not output:
        return None
    out = Path(output)
    if out.exists() and not out.is_dir():
        return f"--output {out} is a file; give a directory"
    blocker = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:  # mkdir would fail after the model loaded: say so now
        return f"--output {out}: {blocker} is a file, so no directory can be made under it"
    if out.is_dir():
        who = runlock.holder(out)  # another writer: refused whatever the flags say
        if who is not None:
            return runlock.in_progress_message(out, who)
    has_run = out.is_dir() and any((out / n).exists() for n in run_record.RUN_MARKERS)
    if has_run and not (resume or overwrite):
        return (
            f"--output {out} already holds a run; add --resume to continue it from its newest "
            "checkpoint, --overwrite to replace it, or choose another directory"
        )
    foreign = run_files.foreign_files(out) if out.is_dir() and not has_run else []
    if foreign and not overwrite:  # --resume has no run here to continue: refused too
        names = ", ".join(foreign)
        return (
            f"--output {out} is not a pitstop run but holds {names}, which pitstop train "
            f"writes and would replace; choose another --output, move them away, or add "
            f"--overwrite to let the run replace {'it' if len(foreign) == 1 else 'them'} "
            "(your other files there stay)"
        )
    return None


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # either one missing: the same path, or not the same file
        return a.resolve() == b.resolve()


def config_file_problem(config: str | None, cfg: RunConfig) -> str | None:
    """Why the `--config` file would be lost by training `cfg` (it is a file the run writes
    in --output: removed by --overwrite, or rewritten), or None. Reads only.

    `--config OUT/config.yaml --resume` stays allowed: a resumed run keeps a differing
    previous config.yaml beside it (train/run_dir.py), and an identical one is not changed.
    """
    if not config or not cfg.output:
        return None
    out, given = Path(cfg.output), Path(config)
    name = next((n for n in run_files.TRAIN_WRITES if _same_file(given, out / n)), None)
    if name is None:
        return None
    fix = f"copy it out of {out} and pass the copy to --config, or choose another --output"
    if cfg.overwrite:
        return f"--config {given} is {out / name}, which --overwrite removes; {fix}"
    if name != run_record.CONFIG:
        return f"--config {given} is {out / name}, which the run writes; {fix}"
    try:
        same = given.read_text(encoding="utf-8") == cfg.saved_yaml()
    except (OSError, UnicodeDecodeError):
        same = False
    if not (same or cfg.resume):
        return (
            f"--config {given} is {out / name}, which the run replaces with its own "
            f"configuration; {fix} (with --resume, a differing one is kept beside it)"
        )
    return None


# FSDP2 before torch 2.8 asserts that every parameter of a shard group has one original
# dtype ("FSDP expects uniform original parameter dtype", `FSDPParamGroup._init_mp_dtypes`,
# at the first forward), whatever the mixed-precision policy gathers them as. A LoRA block
# holds its frozen base in the run's precision and its adapter in fp32, so --strategy fsdp
# with --lora-r crashes there unless the base is fp32 too. torch 2.8 checks only the
# trainable parameters (pytorch#154103), which are all fp32 adapters.
FSDP_MIXED_DTYPE_TORCH = (2, 8)


def _torch_version() -> str:
    """The installed torch's version, read without importing torch (the CLI checks
    configurations without loading it)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:  # a source build without metadata: ask torch itself
        import torch

        return str(torch.__version__)


def strategy_problems(
    cfg: RunConfig, *, distributed: bool, torch_version: str | None = None
) -> list[str]:
    """Combinations of the multi-process strategy pitstop does not run (`distributed`:
    several processes; `torch_version`: the installed one when None). Pure config logic:
    the trainer checks the same before wrapping."""
    p = []
    if distributed and cfg.load_in_4bit:
        p.append("--load-in-4bit is single-process only in pitstop; drop it or use --nproc 1")
    # fp32 loads the base in fp32 like the adapter: one dtype per group, nothing to refuse.
    mixed = cfg.strategy == "fsdp" and cfg.lora_r is not None and cfg.precision != "fp32"
    if distributed and mixed:
        found = torch_version if torch_version is not None else _torch_version()
        if parse_version(found)[:2] < FSDP_MIXED_DTYPE_TORCH:
            floor = ".".join(map(str, FSDP_MIXED_DTYPE_TORCH))
            p.append(
                f"--strategy fsdp with --lora-r needs torch >= {floor} (found {found}): "
                "older FSDP2 cannot shard a LoRA block's low-precision base and fp32 "
                f"adapter together; pip install -U 'torch>={floor}', or use --strategy "
                "ddp, or --precision fp32"
            )
    return p


def preflight(cfg: RunConfig, device: DeviceInfo | None = None) -> list[str]:
    """Every problem with `cfg` that needs this machine but no model load: device,
    precision, attention kernel, 4-bit and the multi-process strategy. The messages are
    the ones the trainer raises for the same problem, so the commands can report them
    together with the configuration's own (`config.validate`). `device` defaults to
    the one `cfg.device` selects here."""
    p: list[str] = []
    if device is None:
        # torch is imported where it is needed throughout this module: the CLI imports
        # the probe to check configurations, and must not load torch to do it.
        import torch

        if cfg.device == "cuda" and not torch.cuda.is_available():
            p.append(no_cuda_problem())
        device, _ = detect_device("cpu" if cfg.device == "cpu" else "auto")
    prec = precision_problem(cfg.precision, device)
    if prec:
        p.append(prec)
        precision = cfg.precision
    else:
        precision = choose_precision(cfg.precision, device).value
    for problem in (
        attention_problem(cfg.attention, device, precision),
        four_bit_problem(device) if cfg.load_in_4bit else None,
    ):
        if problem:
            p.append(problem)
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    p += strategy_problems(cfg, distributed=max(cfg.nproc, world) > 1)
    return p


# What each backend does with packed rows (several documents in a row, several rows in a
# micro-batch); the banner quotes it so a user sees why a kernel was or was not chosen.
PACKED_ROWS = {
    "flash_attention_2": "packed rows run its variable-length kernel (pitstop passes each "
    "document's boundaries), so no document sees another and no padding or cross-document "
    "block is computed",
    "flex_attention": "packed rows get a block mask (documents x causal) that skips the "
    "blocks no query may see; no dense mask is built",
    "sdpa_docs": "packed rows run causal SDPA over each document's own span, within the "
    "model's sliding window where it has one (pitstop's per-document kernel; on a GPU documents "
    "of equal length share one call), so a row costs the sum of its documents' squared "
    "lengths, not T x T, and no mask is built",
    "sdpa": "packed rows get a dense [B, 1, T, T] document mask, which rules out SDPA's flash "
    "kernel",
    "eager": "packed rows get a dense [B, 1, T, T] document mask and the T x T scores are kept",
}


def choose_attention(
    requested: str,
    dev: DeviceInfo,
    precision: str,
    measured: dict[str, float] | None = None,
) -> Choice:
    """The attention kernel. `auto`: flash-attn where it runs; else `measured`'s fastest, if
    given; else pitstop's per-document SDPA (`sdpa_docs`).

    `measured` maps kernels to trained tokens/s timed on this device (e.g. by `pitstop
    tune`, or `python -m bench.attention --gpu`); kernels that cannot run here are ignored.
    Without it, `auto` takes sdpa_docs where flash-attn cannot run: it computes what
    flash-attn's varlen path computes (each document's causal attention alone) with SDPA's
    own fused kernels, where plain sdpa computes every row's T x T scores under a dense
    mask. FlexAttention also skips masked blocks, but compiles its kernel on first use and
    is not chosen unmeasured.
    """
    if requested in ("flash_attention_2", "flex_attention"):
        problem = attention_problem(requested, dev, precision)
        if problem:
            raise ConfigError(problem)
        return Choice(requested, f"asked for; {PACKED_ROWS[requested]}")
    if requested == "sdpa_docs":
        return Choice(requested, f"asked for; {PACKED_ROWS[requested]}")
    if requested in ("sdpa", "eager"):
        return Choice(requested, "asked for")
    ok, why = flash_attn_status(dev, precision)
    if ok:
        return Choice("flash_attention_2", f"{why}; {PACKED_ROWS['flash_attention_2']}")
    flex_ok, flex_why = flex_attention_status(dev)
    runnable = {"sdpa_docs": True, "sdpa": True, "eager": True, "flex_attention": flex_ok}
    rates = {k: v for k, v in (measured or {}).items() if runnable.get(k) and v > 0}
    if rates:
        best = max(rates, key=lambda k: rates[k])
        table = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(rates.items(), key=lambda kv: -kv[1]))
        return Choice(
            best, f"fastest measured on this device (trained tok/s: {table}); {PACKED_ROWS[best]}"
        )
    if not flex_ok:
        return Choice("sdpa_docs", f"{why}; {flex_why}; {PACKED_ROWS['sdpa_docs']}")
    return Choice(
        "sdpa_docs",
        f"{why}; {PACKED_ROWS['sdpa_docs']}. --attention flex_attention skips masked blocks "
        "too but compiles on first use; not chosen unmeasured (pitstop tune, or python -m "
        "bench.attention --gpu, measures both here)",
    )


def compile_status() -> tuple[bool, str]:
    import torch

    if not hasattr(torch, "compile"):
        return False, f"torch {torch.__version__} has no torch.compile"
    if os.environ.get("PITSTOP_NO_COMPILE") or os.environ.get("TORCHDYNAMO_DISABLE") == "1":
        return False, "disabled by the environment (PITSTOP_NO_COMPILE / TORCHDYNAMO_DISABLE)"
    return True, "torch.compile is available"


def estimated_run_seconds(
    steps: int, tokens_per_step: int, flops_per_token: float, peak_flops: float | None
) -> float | None:
    """The run length `compile: auto` weighs compile time against (None without a peak).

    An estimate from FLOPs at ASSUMED_MFU_FOR_ESTIMATE of the device's peak, before any
    step has run; the trainer and the tuner both decide with it.
    """
    if not peak_flops:
        return None
    return steps * tokens_per_step * flops_per_token / (peak_flops * ASSUMED_MFU_FOR_ESTIMATE)


def median_lower_bound(values: tuple[float, ...], confidence: float) -> float:
    """A lower bound on the median of the distribution `values` are independent draws from,
    with `confidence`, assuming nothing about its shape: the k-th smallest value, k the
    largest with P(Binomial(n, 1/2) < k) <= 1 - confidence (the order-statistic interval),
    or the smallest value when n is too small for that confidence (three values: 87.5%)."""
    if not values:
        raise ValueError("median_lower_bound of no values")
    ordered, n = sorted(values), len(values)
    k = 1
    while k < n and sum(math.comb(n, i) for i in range(k + 1)) / 2**n <= 1 - confidence:
        k += 1  # P(B < k) <= 1 - confidence still holds for the next k
    return ordered[k - 1]


class CompileFacts(TypedDict):
    """A `CompileSpeed` as JSON (the cache entry's and `choices.compile.measured`'s fields)."""

    compile_seconds: float
    eager_step_seconds: float
    compiled_step_seconds: float
    speedup: float
    speedup_floor: float
    pairs: int
    ratios: list[float]
    source: str


@dataclass(frozen=True)
class CompileSpeed:
    """What torch.compile costs and gains for one configuration, measured on a compiling
    run's steps (pitstop.train.compile_record): the compile, and a step eager and compiled
    (the compiled one: the eager one over the median paired ratio)."""

    compile_s: float  # the first compiled step's seconds above a compiled step's
    eager_step_s: float
    compiled_step_s: float
    source: str  # measured in this run, or reused from the cache (where, when)
    # Each timed eager step (the second of two between compiled ones) over the mean of the
    # compiled steps around them (the gain is the median); none when the speeds were given,
    # not measured in pairs.
    ratios: tuple[float, ...] = ()

    @property
    def pairs(self) -> int:
        return len(self.ratios)

    @property
    def gain(self) -> float:
        return self.eager_step_s / self.compiled_step_s if self.compiled_step_s > 0 else 0.0

    @property
    def gain_floor(self) -> float:
        """The gain the pairs show with COMPILE_GAIN_CONFIDENCE (a lower bound on their
        median), never above the gain; the gain itself without pairs."""
        if not self.ratios:
            return self.gain
        return min(self.gain, median_lower_bound(self.ratios, COMPILE_GAIN_CONFIDENCE))

    def saving(self, steps: int) -> float:
        """Seconds `steps` compiled steps save over eager ones (negative: they cost)."""
        return steps * (self.eager_step_s - self.compiled_step_s)

    def describe(self) -> str:
        over = ""
        if self.pairs:
            sure = f"{COMPILE_GAIN_CONFIDENCE:.0%}"
            over = (
                f", the median of {self.pairs} pairs; {self.gain_floor:.2f}x with {sure} confidence"
            )
        return (
            f"{self.source}: a {self.compile_s:.1f} s compile, then steps of "
            f"{self.eager_step_s:.3f} s eager against {self.compiled_step_s:.3f} s compiled "
            f"({self.gain:.2f}x{over})"
        )

    def to_dict(self) -> CompileFacts:
        return {
            "compile_seconds": self.compile_s,
            "eager_step_seconds": self.eager_step_s,
            "compiled_step_seconds": self.compiled_step_s,
            "speedup": round(self.gain, 4),
            "speedup_floor": round(self.gain_floor, 4),
            "pairs": self.pairs,
            "ratios": [round(r, 4) for r in self.ratios],
            "source": self.source,
        }


def choose_compile(
    requested: str,
    dev: DeviceInfo,
    estimated_run_seconds: float | None,
    *,
    steps: int | None = None,
    measured: CompileSpeed | None = None,
) -> Choice:
    """`auto` compiles when the run is long enough to repay the compile: this
    configuration's measured compile time against its measured per-step gain times the
    run's `steps` (`measured`, from the cache); without a measurement, the estimated run
    length against pitstop's basis (COMPILE_SECONDS_BASIS, COMPILE_GAIN_BASIS), and a run
    that compiles then measures it. Either way the reason gives the numbers.

    One compile per run: every micro-batch shape runs the first graph (the row count is
    marked dynamic, train/compile.py `mark_rows_dynamic`; bucket's width too).

    `Choice.measured` holds what the decision rests on (the measurement, or the estimate)."""
    ok, why = compile_status()
    if requested == "off":
        return Choice(False, "asked for (--compile off)")
    if requested == "on":
        if not ok:
            return Choice(False, f"--compile on, but {why}: running eagerly")
        return Choice(True, "asked for (--compile on); a compile failure falls back to eager")
    if not ok:
        return Choice(False, why)
    if measured is not None and steps:
        return _measured_payoff(measured, steps)
    if estimated_run_seconds is None:
        return Choice(False, "run length unknown, so the compile time may not pay back")
    saving = estimated_run_seconds * (1 - 1 / COMPILE_GAIN_BASIS)
    estimate = {
        "estimated_run_seconds": estimated_run_seconds,
        "compile_seconds_basis": COMPILE_SECONDS_BASIS,
        "gain_basis": COMPILE_GAIN_BASIS,
        "estimated_saving_seconds": saving,
    }
    basis = (
        f"not measured for this configuration yet; estimated run {estimated_run_seconds:.0f} s: "
        f"pitstop's basis (a {COMPILE_SECONDS_BASIS:.0f} s compile, then "
        f"{COMPILE_GAIN_BASIS:.2f}x faster steps) would save "
        f"~{saving:.0f} s"
    )
    if saving >= COMPILE_PAYBACK * COMPILE_SECONDS_BASIS:
        return Choice(
            True,
            basis + f", over {COMPILE_PAYBACK:.0f}x the compile time; this run measures both "
            "on its steps (the first compiled one, and eager ones between compiled ones) for the "
            "next run of this configuration",
            estimate,
        )
    return Choice(
        False, basis + f", less than {COMPILE_PAYBACK:.0f}x the compile time: eager", estimate
    )


def _measured_payoff(speed: CompileSpeed, steps: int) -> Choice:
    """`auto` with this configuration's measurement: compile when its pairs show compiled
    steps faster with COMPILE_GAIN_CONFIDENCE (`CompileSpeed.gain_floor` above 1x) and
    `steps` of them save more than the compile at the median gain."""
    saving = speed.saving(steps)
    facts = {**speed.to_dict(), "steps": steps, "saving_seconds": saving}
    head = f"{speed.describe()}; "
    if saving <= 0:
        return Choice(False, head + "compiled steps are no faster: eager", facts)
    if speed.gain_floor <= 1.0:
        return Choice(
            False,
            head
            + f"compiled steps are not measurably faster (the gain may be {speed.gain_floor:.2f}x "
            "or less): eager",
            facts,
        )
    head += f"over this run's {steps} steps "
    if saving >= speed.compile_s:
        return Choice(True, head + f"it saves ~{saving:.0f} s, over the compile time", facts)
    return Choice(
        False, head + f"it would save ~{saving:.0f} s, less than the compile time: eager", facts
    )


def choose_optimizer(dev: DeviceInfo) -> Choice:
    if dev.type == "cuda":
        return Choice(
            "adamw_fused",
            "CUDA: fused AdamW (one kernel for all parameters; skips non-finite steps without a sync)",
        )
    if dev.type == "cpu":
        # torch's CPU kernel for fused AdamW (torch >= 2.4) makes one pass over each
        # parameter; the foreach update makes a pass per arithmetic op: 7.5 ms against 27.0 ms a
        # step for the headline's 8.4M parameters (bench/step_kernels.py, 2-core Xeon).
        return Choice("adamw_fused", "CPU: fused AdamW (one pass over each parameter)")
    return Choice("adamw_foreach", f"{dev.type}: AdamW with multi-tensor (foreach) updates")


def choose_host_memory(
    requested: str, dev: DeviceInfo, environ: Mapping[str, str] | None = None
) -> Choice:
    """Whether the run keeps freed host memory for its next step (core/host_malloc.py):
    `auto` on a CPU run, unless the process already chose its allocator (read from `environ`)
    or an earlier run in it already keeps freed memory. It only decides;
    `apply_host_memory` acts on the decision."""
    keep = requested == "on" or (requested == "auto" and dev.type != "cuda")
    if not keep and host_malloc.kept_in_this_process():
        return Choice(
            True,
            f"--keep-freed-memory {requested}, but an earlier run in this process already keeps "
            "freed memory (glibc's mallopt has no way back): start a new process for glibc's "
            "defaults",
        )
    if requested == "off":
        return Choice(False, "--keep-freed-memory off: glibc's defaults")
    if not keep:
        return Choice(False, "a GPU run: its tensors live in CUDA's caching allocator")
    own = host_malloc.own_allocator_setting(environ)
    if own is not None:
        return Choice(False, f"the process's own allocator setting is kept ({own})")
    how = "--keep-freed-memory on" if requested == "on" else "CPU training"
    return Choice(
        True,
        f"{how}: freed host memory is kept for the next step (glibc mallopt: mmap and trim "
        "thresholds raised), so a step does not page-fault its tensors in again",
    )


def apply_host_memory(choice: Choice) -> Choice:
    """Act on `choose_host_memory`'s decision; the choice as it stands after (why not, if
    glibc could not do it)."""
    if not choice.value:
        return choice
    problem = host_malloc.keep_freed()
    return choice if problem is None else Choice(False, f"not kept: {problem}")


def apply_backend_flags(dev: DeviceInfo, tf32: Choice) -> None:
    """Set the global torch flags the choices imply (TF32)."""
    import torch

    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = bool(tf32.value)
        torch.backends.cudnn.allow_tf32 = bool(tf32.value)
