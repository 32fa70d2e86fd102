"""The environment report: what this machine can do for a training run.

Device facts come from `pitstop.probe` (one place decides device, bf16, flash-attn
and compile support); this module adds the versions, the driver, TF32 flags, CPU
cores against loader workers, whether torch.compile actually works here, and the
read throughput of the disk holding the data.

The compile check compiles a tiny function in a child process (a broken compiler
toolchain can hang or crash the process that tries it) with a time limit, and
caches the result in the cache directory, keyed by the torch and Python versions.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any, TypedDict

from pitstop.core.atomic import write_cache_entry
from pitstop.core.cache_layout import COMPILE_CHECK, keyed_cache_path
from pitstop.probe import DeviceInfo, compile_status, detect_device, flash_attn_status


class Tf32State(TypedDict):
    matmul_allow_tf32: bool
    cudnn_allow_tf32: bool
    float32_matmul_precision: str


class CompileCheck(TypedDict, total=False):
    """Whether torch.compile works here; `seconds` when it was tried, `cached` when reused."""

    checked: bool
    works: bool
    reason: str
    seconds: float
    cached: str


class DiskRead(TypedDict, total=False):
    """A sequential read of the data (`read_throughput`); `error` alone when nothing was read."""

    path: str
    error: str
    bytes_read: int
    seconds: float
    bytes_per_second: float | None
    cold: bool
    note: str | None


class FlashAttnState(TypedDict):
    installed: str | None
    usable: bool
    reason: str


class Workers(TypedDict, total=False):
    cpu_cores: int
    loader_workers: int | None
    note: str


class Environment(TypedDict, total=False):
    """The environment report (JSON-serialisable): what `environment` probes. A caller (a test,
    a pretend machine) may pass part of it; every reader allows a key to be missing."""

    python: str
    platform: str
    torch: str
    cuda: str | None
    driver: str | None
    transformers: str | None
    trl: str | None
    peft: str | None
    device: dict[str, Any]  # DeviceInfo.to_dict()
    bf16: bool
    flash_attn: FlashAttnState
    tf32: Tf32State
    workers: Workers
    compile: CompileCheck
    disk: DiskRead


READ_LIMIT_BYTES = 256 * 1024 * 1024
COMPILE_TIMEOUT_S = 180.0
_COMPILE_SNIPPET = """
import torch
f = torch.compile(lambda x: torch.sin(x) * 2 + 1)
x = torch.randn(8, device={device!r})
assert torch.allclose(f(x), torch.sin(x) * 2 + 1)
print("ok")
"""


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def driver_version() -> str | None:
    """The NVIDIA driver version through NVML, or None (no nvidia-ml-py or no driver)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:  # ImportError, NVMLError: no driver to report
        return None


def tf32_state() -> Tf32State:
    import torch

    return Tf32State(
        matmul_allow_tf32=bool(torch.backends.cuda.matmul.allow_tf32),
        cudnn_allow_tf32=bool(torch.backends.cudnn.allow_tf32),
        float32_matmul_precision=torch.get_float32_matmul_precision(),
    )


def check_compile(
    device: str = "cpu", cache_dir: str | Path | None = None, timeout_s: float = COMPILE_TIMEOUT_S
) -> CompileCheck:
    """Whether torch.compile compiles and runs a tiny function here (cached per versions)."""
    import torch

    ok, why = compile_status()
    if not ok:
        return CompileCheck(checked=False, works=False, reason=why)
    key = {"torch": torch.__version__, "python": platform.python_version(), "device": device}
    path = keyed_cache_path(cache_dir, COMPILE_CHECK, key)
    if path is not None and path.is_file():
        try:
            rec = json.loads(path.read_text(encoding="utf-8"))
            if rec.get("key") == key:  # a result this function wrote, for these versions
                return {**rec["result"], "cached": str(path)}
        except (ValueError, KeyError, OSError):
            pass
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _COMPILE_SNIPPET.format(device=device)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        works = proc.returncode == 0 and "ok" in proc.stdout
        tail = (proc.stderr or "").strip().splitlines()[-1:] if not works else []
        reason = "compiled and ran a tiny function" if works else f"failed: {' '.join(tail)}"
    except subprocess.TimeoutExpired:
        works, reason = False, f"a tiny compile did not finish in {timeout_s:.0f} s"
    result = CompileCheck(
        checked=True, works=works, seconds=round(time.perf_counter() - t0, 2), reason=reason
    )
    if path is not None:
        write_cache_entry(path, json.dumps({"key": key, "result": result}))
    return result


def read_throughput(path: str | Path, limit_bytes: int = READ_LIMIT_BYTES) -> DiskRead:
    """Sequential read speed of `path` (for a directory, its largest file), up to `limit_bytes`.

    The file's pages are dropped from the page cache first where the OS allows it
    (posix_fadvise DONTNEED), so the number is the disk's, not memory's; `cold`
    says whether that was possible.
    """
    p = Path(path)
    if p.is_dir():
        files = [f for f in p.rglob("*") if f.is_file()]
        if not files:
            return DiskRead(path=str(p), error="no files to read")
        p = max(files, key=lambda f: f.stat().st_size)
    if not p.is_file():
        return DiskRead(path=str(p), error="not a file")
    cold = False
    chunk = 8 * 1024 * 1024
    read = 0
    fd = os.open(p, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                cold = True
            except OSError:
                pass
        t0 = time.perf_counter()
        while read < limit_bytes:
            b = os.read(fd, min(chunk, limit_bytes - read))
            if not b:
                break
            read += len(b)
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
    return DiskRead(
        path=str(p),
        bytes_read=read,
        seconds=round(dt, 6),
        bytes_per_second=read / dt if dt > 0 else None,
        cold=cold,
        note=None if cold else "may have been served from the page cache",
    )


def environment(
    *,
    data: str | Path | None = None,
    loader_workers: int | None = None,
    cache_dir: str | Path | None = None,
    compile_check: bool = True,
    device: DeviceInfo | None = None,
) -> Environment:
    """The environment report (JSON-serialisable). `device` overrides the probe (tests)."""
    import torch

    dev = device or detect_device("auto")[0]
    precision = "bf16" if dev.bf16 else ("fp16" if dev.type == "cuda" else "fp32")
    fa_ok, fa_why = flash_attn_status(dev, precision)
    workers = Workers(cpu_cores=dev.cpu_count, loader_workers=loader_workers)
    if loader_workers is not None and loader_workers > max(1, dev.cpu_count - 1):
        workers["note"] = (
            f"{loader_workers} workers on {dev.cpu_count} cores: workers and the training "
            "process compete for cores"
        )
    env = Environment(
        python=platform.python_version(),
        platform=platform.platform(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        driver=driver_version() if dev.type == "cuda" else None,
        transformers=_version("transformers"),
        trl=_version("trl"),
        peft=_version("peft"),
        device=dev.to_dict(),
        bf16=dev.bf16,
        flash_attn=FlashAttnState(
            installed=_version("flash-attn") or _version("flash_attn"), usable=fa_ok, reason=fa_why
        ),
        tf32=tf32_state(),
        workers=workers,
    )
    if compile_check:
        env["compile"] = check_compile(dev.torch_device.split(":")[0], cache_dir)
    else:
        ok, why = compile_status()
        env["compile"] = CompileCheck(checked=False, works=ok, reason=why + " (not test-compiled)")
    if data is not None:
        env["disk"] = read_throughput(data)
    return env


def format_environment(env: Environment) -> str:
    d = env.get("device", {})
    mem = d.get("total_memory_bytes")
    dev = d.get("name", "?") + (f", {mem / 2**30:.0f} GiB" if mem else "")
    if d.get("capability"):
        dev += f", compute capability {d['capability'][0]}.{d['capability'][1]}"
    fa = env.get("flash_attn", {})
    comp = env.get("compile", {})
    lines = [
        f"python {env.get('python')}  torch {env.get('torch')}  cuda {env.get('cuda') or '-'}"
        f"  driver {env.get('driver') or '-'}  transformers {env.get('transformers') or '-'}"
        f"  trl {env.get('trl') or '-'}",
        f"device       {d.get('type', '?')}: {dev}; bf16 {'yes' if env.get('bf16') else 'no'}",
        f"flash-attn   {fa.get('installed') or 'not installed'}; "
        f"{'usable' if fa.get('usable') else 'not usable'}: {fa.get('reason')}",
        f"compile      {'works' if comp.get('works') else 'does not work'}: {comp.get('reason')}",
        f"tf32         matmul {env.get('tf32', {}).get('matmul_allow_tf32')}, "
        f"float32 matmul precision {env.get('tf32', {}).get('float32_matmul_precision')}",
        f"cpu cores    {env.get('workers', {}).get('cpu_cores')}"
        + (
            f", loader workers {env['workers']['loader_workers']}"
            if env.get("workers", {}).get("loader_workers") is not None
            else ""
        ),
    ]
    disk = env.get("disk")
    if disk and disk.get("bytes_per_second"):
        lines.append(
            f"disk read    {disk['bytes_per_second'] / 1e6:,.0f} MB/s over "
            f"{disk['bytes_read'] / 1e6:,.1f} MB of {disk['path']}"
            + ("" if disk.get("cold") else " (may be cached)")
        )
    return "\n".join(lines)
