"""Keep freed host memory for the next step: glibc's `mallopt`, for training on the CPU.

A CPU training step allocates and frees the same large tensors every step (activations,
the logits, gradients). glibc hands a freed block above its mmap threshold back to the OS
(`munmap`), and trims the top of its heap above its trim threshold; the next step's
allocation of the same size then faults every 4 KiB page in again, each zero-filled by the
kernel. On the headline model (2-core Intel Xeon, fp32, 2 x 1024 positions a micro-batch)
that was about 78,000 minor page faults per optimizer step, and the runs trained 1.02-1.07x
faster without them (`python -m bench.host_malloc`, bench/results/host_malloc.md).

Raising both thresholds keeps freed memory in the heap, where the next allocation of the
size reuses it: no page faults in steady state, and the peak resident memory stays that of
the step's peak (freed blocks are reused, not added). The setting is process-wide and
affects allocations made after it; forked loader workers inherit it.

Written by hand because the libraries that do this (jemalloc, tcmalloc) must be preloaded
before the process starts (`LD_PRELOAD`); `mallopt` works from inside the running process.
A process that already chose its allocator (a preloaded one, or glibc's own environment
variables and tunables) is left as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import platform
import resource
import time
from collections.abc import Mapping

__all__ = [
    "KEEP_ENV",
    "fault_record",
    "keep_freed",
    "minor_faults",
    "own_allocator_setting",
    "page_fault_seconds",
]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc refuses an mmap threshold above its ceiling (32 MiB on 64-bit, or half the heap
# size on newer releases): the largest one it takes is used.
_MMAP_THRESHOLDS = (1 << 30, 1 << 25)
_TRIM_THRESHOLD = (1 << 31) - 1  # an int: never trim the heap's top
# The same two settings as environment variables, which glibc reads when a process starts:
# what the doctor tells a script to run with (advise/rules/memory.py `host-page-faults`).
KEEP_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(_MMAP_THRESHOLDS[0]),
    "MALLOC_TRIM_THRESHOLD_": str(_TRIM_THRESHOLD),
}
_PRELOADED = ("jemalloc", "tcmalloc", "mimalloc")
_GLIBC_ENV = (*KEEP_ENV, "MALLOC_TOP_PAD_")


def own_allocator_setting(environ: Mapping[str, str] | None = None) -> str | None:
    """The process's own allocator setting, where it has one (then pitstop keeps it)."""
    env = os.environ if environ is None else environ
    preload = env.get("LD_PRELOAD", "")
    for name in _PRELOADED:
        if name in preload:
            return f"LD_PRELOAD={preload}"
    for name in _GLIBC_ENV:
        if name in env:
            return f"{name}={env[name]}"
    if "glibc.malloc" in env.get("GLIBC_TUNABLES", ""):
        return f"GLIBC_TUNABLES={env['GLIBC_TUNABLES']}"
    return None


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") else None


_kept = False  # this process raised the thresholds (mallopt has no way back to the defaults)


def kept_in_this_process() -> bool:
    """Whether an earlier `keep_freed` in this process (a run before this one) succeeded."""
    return _kept


def keep_freed() -> str | None:
    """Raise glibc's mmap and trim thresholds for this process; None when done, else why not."""
    global _kept
    family = platform.libc_ver()[0]
    if family != "glibc":
        return f"not glibc ({family or platform.system()}): mallopt is glibc's"
    libc = _libc()
    if libc is None:
        return "glibc's mallopt could not be loaded"
    if not any(libc.mallopt(_M_MMAP_THRESHOLD, t) == 1 for t in _MMAP_THRESHOLDS):
        return "glibc refused a higher mmap threshold"
    if libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) != 1:
        return "glibc refused a higher trim threshold"
    _kept = True
    return None


def minor_faults() -> int:
    """Minor page faults of this process so far (pages the kernel mapped in on first touch)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def page_fault_seconds(mib: int = 32, repeats: int = 5) -> float | None:
    """Wall seconds one minor page fault adds to a step here: a fresh tensor filled by
    torch (its intra-op threads, as a step's kernels write their outputs), less a fill of
    the same, now mapped, memory, per fault the kernel counted. None where no fault was
    seen (memory kept, or huge pages).

    The fastest fresh fill less the fastest refill, each over `repeats`: on a busy machine
    one slow refill taken from its own fresh fill read near zero (a CI run's finding went
    missing that way), while the two minimums each approach the quiet machine's time.
    Measured 0.8-1.4 us on the 2-core dev box (a virtual machine), 1.9-3.1 us with three
    busy processes beside it; a single thread touching pages pays 2.3-2.5 us, and two
    threads fault in parallel."""
    import torch

    fresh, again, faults = [], [], []
    for _ in range(repeats):
        # An mmap of its own (not the heap), so every page is fresh whatever malloc keeps.
        region = mmap.mmap(-1, mib << 20)
        t = torch.frombuffer(region, dtype=torch.float32)
        f0, t0 = minor_faults(), time.perf_counter()
        t.fill_(1.0)
        fresh.append(time.perf_counter() - t0)
        faults.append(minor_faults() - f0)
        for value in (2.0, 3.0):
            t0 = time.perf_counter()
            t.fill_(value)
            again.append(time.perf_counter() - t0)
        del t
        region.close()
    counted = sorted(faults)[len(faults) // 2]
    if counted <= 0:
        return None
    return max(min(fresh) - min(again), 0.0) / counted


def fault_record(per_step: float) -> dict[str, float | None]:
    """A CPU profile's page-fault fields: the faults per measured step and what one costs
    here (the doctor's `host-page-faults` finding reads both)."""
    return {"host_page_faults_per_step": per_step, "page_fault_seconds": page_fault_seconds()}
