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
import os
from dataclasses import asdict, dataclass
from typing import Any

from pitstop.errors import ConfigError

# torch.compile cost/benefit basis, measured for pitstop on CPU: a 7.6M-parameter Llama
# took 63 s to compile and then ran its steps 1.06x faster. Without a measurement on the
# user's machine, `--compile auto` only compiles when the run is long enough that this
# gain pays the compile time back several times over.
COMPILE_SECONDS_BASIS = 63.0
COMPILE_GAIN_BASIS = 1.06
COMPILE_PAYBACK = 3.0  # the estimated saving must exceed the compile time this many times
# Used only to estimate a run's length before it starts (for `--compile auto`).
ASSUMED_MFU_FOR_ESTIMATE = 0.3


@dataclass(frozen=True)
class Choice:
    """One decision and why it was made."""

    value: Any
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"value": self.value, "reason": self.reason}


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


def detect_device(requested: str = "auto", *, index: int = 0) -> tuple[DeviceInfo, Choice]:
    """Find the device to train on; `requested` is cfg.device (auto, cpu, cuda)."""
    import torch

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    has_cuda = torch.cuda.is_available()
    if requested == "cuda" and not has_cuda:
        raise ConfigError(
            "--device cuda was asked for, but torch sees no CUDA device "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); "
            "use --device cpu or install a CUDA build of torch"
        )
    if requested == "cpu" or not has_cuda:
        why = (
            "asked for with --device cpu"
            if requested == "cpu"
            else "no CUDA device visible to torch"
        )
        info = DeviceInfo(type="cpu", name=cpu_name(), bf16=False, cpu_count=cpus)
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


def choose_precision(requested: str, dev: DeviceInfo) -> Choice:
    """bf16 autocast where the GPU has it, fp16 + GradScaler on older GPUs, fp32 on CPU."""
    if dev.type == "cpu":
        if requested in ("bf16", "fp16"):
            raise ConfigError(
                f"--precision {requested} needs a CUDA GPU; this run is on the CPU, where pitstop "
                "trains in fp32 (CPU autocast is slower than fp32 on most CPUs); "
                "use --precision fp32 or auto"
            )
        why = (
            "asked for"
            if requested == "fp32"
            else "CPU: fp32 (reduced-precision autocast is not faster on CPUs)"
        )
        return Choice("fp32", why)
    if requested == "bf16":
        if not dev.bf16:
            raise ConfigError(
                f"--precision bf16: {dev.name} (compute capability {dev.capability}) has no bf16 "
                "support; use --precision fp16 (with loss scaling) or auto"
            )
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


def choose_attention(requested: str, dev: DeviceInfo, precision: str) -> Choice:
    ok, why = flash_attn_status(dev, precision)
    if requested == "flash_attention_2":
        if not ok:
            raise ConfigError(
                f"--attention flash_attention_2 is not possible: {why}; use sdpa or auto"
            )
        return Choice("flash_attention_2", "asked for; " + why)
    if requested in ("sdpa", "eager"):
        return Choice(requested, "asked for")
    if ok:
        return Choice(
            "flash_attention_2", why + "; varlen kernels skip padding and cross-document work"
        )
    return Choice("sdpa", f"PyTorch scaled-dot-product attention ({why})")


def compile_status() -> tuple[bool, str]:
    import torch

    if not hasattr(torch, "compile"):
        return False, f"torch {torch.__version__} has no torch.compile"
    if os.environ.get("PITSTOP_NO_COMPILE") or os.environ.get("TORCHDYNAMO_DISABLE") == "1":
        return False, "disabled by the environment (PITSTOP_NO_COMPILE / TORCHDYNAMO_DISABLE)"
    return True, "torch.compile is available"


def choose_compile(requested: str, dev: DeviceInfo, estimated_run_seconds: float | None) -> Choice:
    """`auto` compiles only when the estimated saving repays the compile time several times.

    The basis is pitstop's own measurement (COMPILE_SECONDS_BASIS, COMPILE_GAIN_BASIS);
    it is an estimate, and the banner says so.
    """
    ok, why = compile_status()
    if requested == "off":
        return Choice(False, "asked for (--compile off)")
    if requested == "on":
        if not ok:
            return Choice(False, f"--compile on, but {why}: running eagerly")
        return Choice(True, "asked for (--compile on); a compile failure falls back to eager")
    if not ok:
        return Choice(False, why)
    if estimated_run_seconds is None:
        return Choice(False, "run length unknown, so the compile time may not pay back")
    saving = estimated_run_seconds * (1 - 1 / COMPILE_GAIN_BASIS)
    basis = (
        f"estimated run {estimated_run_seconds:.0f} s; basis: a {COMPILE_SECONDS_BASIS:.0f} s compile "
        f"then {COMPILE_GAIN_BASIS:.2f}x faster steps (measured on CPU, tiny Llama) "
        f"would save ~{saving:.0f} s"
    )
    if saving >= COMPILE_PAYBACK * COMPILE_SECONDS_BASIS:
        return Choice(True, basis + f", over {COMPILE_PAYBACK:.0f}x the compile time")
    return Choice(False, basis + f", less than {COMPILE_PAYBACK:.0f}x the compile time")


def choose_optimizer(dev: DeviceInfo) -> Choice:
    if dev.type == "cuda":
        return Choice(
            "adamw_fused",
            "CUDA: fused AdamW (one kernel for all parameters; skips non-finite steps without a sync)",
        )
    return Choice("adamw_foreach", "CPU: AdamW with multi-tensor (foreach) updates")


def apply_backend_flags(dev: DeviceInfo, tf32: Choice) -> None:
    """Set the global torch flags the choices imply (TF32)."""
    import torch

    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = bool(tf32.value)
        torch.backends.cudnn.allow_tf32 = bool(tf32.value)
