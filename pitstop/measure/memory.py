"""Peak memory of this process: the one reading every run record and profile uses.

CUDA: the caching allocator's peak of memory allocated by tensors. CPU on Linux: the
process's resident-set high-water mark, `VmHWM` in /proc/self/status, which writing 5 to
/proc/self/clear_refs resets, so one process can measure several windows in a row.

Why not `getrusage(RUSAGE_SELF).ru_maxrss`: on Linux it is the larger of this address
space's high-water mark and the `maxrss` the kernel carried over at exec from the address
space the process was started from. A `pitstop train` started by a 1 GiB parent (a notebook,
pytest, a benchmark harness) would report 1 GiB before allocating anything; VmHWM belongs
to this process's own address space only. `ru_maxrss` is the fallback where /proc is absent
(macOS, where it is bytes rather than KiB).
"""

from __future__ import annotations

import os
import resource


def reset_peak_memory(device_type: str) -> bool:
    """Start a new peak-memory window; False when the platform cannot reset it."""
    if device_type == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats()
        return True
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_memory(device_type: str) -> int:
    """Peak bytes since the last `reset_peak_memory`: CUDA allocated, or peak RSS on CPU."""
    if device_type == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated())
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if os.uname().sysname == "Darwin" else rss * 1024)
