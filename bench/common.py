"""Helpers every benchmark shares: the machine description, medians, Markdown tables.

A benchmark prints its table and writes it, with the machine it ran on and the
exact command that produced it, to ``bench/results/NAME.md`` so the docs can
quote numbers that anyone can reproduce with one command.
"""

from __future__ import annotations

import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
REPO_ROOT = BENCH_DIR.parent


def cpu_model() -> str:
    """The CPU model name (pitstop's probe reads /proc/cpuinfo)."""
    from pitstop.probe import cpu_name

    return cpu_name()


def cpu_cores() -> int:
    """Cores this process may run on (the affinity mask, not the host's total)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def memory_gib() -> float | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def machine() -> dict[str, Any]:
    """What the numbers were measured on: CPU, cores, memory, GPU (if any), library versions."""
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": cpu_cores(),
        "memory_gib": memory_gib(),
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["cuda"] = torch.version.cuda
            info["gpu_memory_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
            info["gpu_driver"] = gpu_driver()
    except ImportError:
        pass
    for lib in ("transformers", "trl", "accelerate", "datasets", "flash_attn"):
        try:
            mod = __import__(lib)
            info[lib] = getattr(mod, "__version__", "?")
        except Exception:  # absent, or a native extension that does not load here
            continue
    return info


def gpu_driver() -> str | None:
    """The NVIDIA driver version (nvidia-smi), or None where it cannot be asked."""
    import subprocess

    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip().splitlines()[0] if out.strip() else None


def describe_machine(info: dict[str, Any] | None = None) -> str:
    """One line naming the machine, e.g. ``Intel Xeon … (2 cores, 24 GiB), torch 2.13.0``."""
    m = info or machine()
    mem = f", {m['memory_gib']:.0f} GiB" if m.get("memory_gib") else ""
    parts = [f"{m['cpu']} ({m['cores']} cores{mem})"]
    if m.get("gpu"):
        mem = f", {m['gpu_memory_gib']:.0f} GiB" if m.get("gpu_memory_gib") else ""
        parts.append(f"GPU {m['gpu']} ({mem[2:] + ', ' if mem else ''}driver "
                     f"{m.get('gpu_driver') or 'unknown'}, CUDA {m.get('cuda')})")  # fmt: skip
    names = ("torch", "transformers", "trl", "accelerate", "datasets", "flash_attn")
    libs = [f"{k} {m[k]}" for k in names if k in m]
    return ", ".join(parts + libs) + f", Python {m['python']}, {m['os']}"


def median(values: Iterable[float]) -> float:
    """The median; raises ValueError on no values (a benchmark that measured nothing)."""
    vals = list(values)
    if not vals:
        raise ValueError("median of no measurements")
    return statistics.median(vals)


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that reproduces this run, as a user would type it from the repo root."""
    args = list(sys.argv[1:] if argv is None else argv)
    module = sys.modules["__main__"].__spec__
    head = f"python -m {module.name}" if module is not None else f"python {sys.argv[0]}"
    return " ".join([head, *(shlex.quote(a) for a in args)])


def fmt(value: Any, spec: str = "", *, na: str = "n/a") -> str:
    """Format a table cell; None becomes ``n/a``."""
    if value is None:
        return na
    if isinstance(value, str):
        return value
    return format(value, spec)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub Markdown table; numbers right-aligned, text left-aligned."""

    def cell(v: Any) -> str:
        return str(v).replace("|", "\\|").replace("\n", " ")

    def numeric(col: int) -> bool:
        vals = [str(r[col]) for r in rows if str(r[col]) not in ("n/a", "", "—")]
        return bool(vals) and all(
            v.replace(".", "", 1)
            .replace("%", "")
            .replace("×", "")
            .replace(",", "")
            .lstrip("-+")
            .isdigit()
            for v in vals
        )

    align = ["---:" if numeric(i) else ":---" for i in range(len(headers))]
    lines = [
        "| " + " | ".join(cell(h) for h in headers) + " |",
        "| " + " | ".join(align) + " |",
    ]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def write_result(
    name: str,
    title: str,
    body: str,
    *,
    command: str | None = None,
    machine_info: dict[str, Any] | None = None,
    path: Path | None = None,
) -> Path:
    """Write ``bench/results/NAME.md`` (or `path`): title, machine, command, date, body.

    Written to a temporary file first and renamed, so a crash never leaves half a table.
    """
    out = path or RESULTS_DIR / f"{name}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    text = "\n".join(
        [
            f"# {title}",
            "",
            f"- machine: {describe_machine(machine_info)}",
            f"- command: `{command or command_line()}`",
            f"- date: {time.strftime('%Y-%m-%d %H:%M %Z')}",
            "",
            body.rstrip(),
            "",
        ]
    )
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, out)
    return out


def corpus_store(dest: Path, model_dir: Path, n_docs: int, max_len: int) -> Path:
    """A token store of the first `n_docs` bundled-corpus documents, split into rows of
    `max_len` (a document's first token is never a target), written directly so a
    benchmark's set-up does not depend on `pitstop prepare`."""
    import numpy as np
    from transformers import AutoTokenizer

    from pitstop.core.corpus import sample_texts
    from pitstop.data.store import StoreWriter

    tok = AutoTokenizer.from_pretrained(model_dir)
    toks, masks, lens = [], [], []
    for text in sample_texts(n_docs):
        ids = tok(text)["input_ids"] + [tok.eos_token_id]
        for a in range(0, len(ids), max_len):
            c = ids[a : a + max_len]
            m = np.ones(len(c), np.uint8)
            m[0] = 0 if a == 0 else 1
            toks.append(np.asarray(c))
            masks.append(m)
            lens.append(len(c))
    w = StoreWriter(dest, vocab_size=len(tok))
    w.append(np.concatenate(toks), np.concatenate(masks), lens, np.arange(len(lens)))
    w.finish(
        {"max_seq_len": max_len, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    )
    return dest
