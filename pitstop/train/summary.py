"""The run's outputs others read: summary.json and metrics.jsonl, written safely.

summary.json is replaced atomically (temporary file + os.replace). metrics.jsonl
grows by whole lines, each batch of lines in one write() on an O_APPEND file, so a
reader sees complete lines (a crash can at worst cut the last one, which readers
skip); when a resumed run drops the lines a dead process wrote after its last
checkpoint, the file is rewritten to a temporary file and replaced atomically.
"""

from __future__ import annotations

import json
import math
import os
import resource
from pathlib import Path
from typing import Any

from pitstop.atomic import write_text_atomic


def _clean(v: Any) -> Any:
    """JSON has no NaN/Inf: a non-finite number is written as null."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def jsonl_text(records: list[dict[str, Any]]) -> str:
    """metrics.jsonl lines for `records` (non-finite numbers as null)."""
    return "".join(json.dumps({k: _clean(v) for k, v in r.items()}) + "\n" for r in records)


def append_lines(path: Path, records: list[dict[str, Any]]) -> None:
    if not records:
        return
    text = jsonl_text(records)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, text.encode("utf-8"))
    finally:
        os.close(fd)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every complete line of a metrics.jsonl (a torn last line is skipped)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def truncate_metrics(path: Path, last_step: int) -> None:
    """Keep only lines of steps <= `last_step` (a resumed run rewrites what came after)."""
    if not path.is_file():
        return
    kept = [r for r in read_metrics(path) if int(r.get("step", 0)) <= last_step]
    write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))


def peak_memory_bytes(device_type: str) -> int:
    """CUDA: max memory allocated by tensors; CPU: the process's peak resident set."""
    if device_type == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated())
    # ru_maxrss is KiB on Linux (bytes on macOS).
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if os.uname().sysname == "Darwin" else rss * 1024)
