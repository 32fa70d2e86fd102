"""Where a training step's CPU time goes, eager and compiled: what bounds torch.compile's gain.

`torch.compile` fuses the elementwise work around the matrix products and attention; it does
not make those faster. So the share of a step's CPU-op time outside matrix products and
attention bounds what compiling can gain. This runs `pitstop profile --trace` of the
headline model (bench/compile_payoff.py's setup) eagerly and compiled, in turn, and sums
the self time of the CPU ops in each torch.profiler trace by kind:

- matmul: `aten::mm`, `aten::addmm`, `aten::bmm`, `aten::matmul`
- attention: the fused SDPA kernels (`*scaled_dot_product*`)
- compiled graphs: inductor's fused code (`CompiledFxGraph`)
- the rest: every other op (elementwise, norms, the loss, the optimizer's updates, copies)

Self time is an op's time less the ops it called, computed from the trace's nesting per
thread. Written here because torch.profiler's own tables need the live profiler object; the
trace file is what `pitstop profile --trace` leaves.

Usage:
    python -m bench.op_shares                 # profile both and write bench/results/op_shares.md
    python -m bench.op_shares --out bench/results/op_shares-bf16.md  # another machine kind
    python -m bench.op_shares --trace A.json  # summarise traces already taken
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from bench.common import REPO_ROOT, command_line, machine, markdown_table, write_result
from bench.compile_payoff import headline_setup
from bench.headline import _pitstop_flags

KINDS = ("matmul", "attention", "compiled graphs", "the rest")
_MATMUL = {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul"}


def kind(name: str) -> str:
    if name in _MATMUL:
        return "matmul"
    if "scaled_dot_product" in name:
        return "attention"
    if "CompiledFxGraph" in name:
        return "compiled graphs"
    return "the rest"


def self_times(trace: Path) -> Counter[str]:
    """Seconds of self time per CPU op name (and per inductor graph call) in a Chrome trace."""
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    threads: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            threads[(e.get("pid"), e.get("tid"))].append(e)
    out: Counter[str] = Counter()
    for es in threads.values():
        es.sort(key=lambda e: (e["ts"], -e["dur"]))
        own = [float(e["dur"]) for e in es]
        stack: list[int] = []  # indices of the open events enclosing the current one
        for i, e in enumerate(es):
            while stack and es[stack[-1]]["ts"] + es[stack[-1]]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                own[stack[-1]] -= e["dur"]
            stack.append(i)
        for e, t in zip(es, own):
            if e.get("cat") == "cpu_op" or "CompiledFxGraph" in e["name"]:
                out[e["name"]] += t / 1e6
    return out


def shares(times: Counter[str]) -> dict[str, float]:
    by_kind = Counter({k: 0.0 for k in KINDS})
    for name, t in times.items():
        by_kind[kind(name)] += t
    total = sum(by_kind.values()) or 1.0
    return {k: by_kind[k] / total for k in KINDS}


def profile(compile_: str, workdir: Path) -> tuple[Path, float]:
    """One `pitstop profile --trace` of the headline setup: (its trace, median step seconds)."""
    setup = headline_setup(workdir / "setup")
    trace_dir, out = workdir / f"trace-{compile_}", workdir / f"profile-{compile_}.json"
    for p in trace_dir.glob("*.json"):
        p.unlink()  # this script's own earlier trace
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pitstop", "profile", *_pitstop_flags(setup, workdir / "cache")]
    cmd += ["--compile", compile_, "--warmup", "8", "--steps", "3", "--trace", str(trace_dir)]
    cmd += ["--output", str(out)]
    print(f"[op_shares] {compile_}: {' '.join(cmd[3:])}", flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    step = json.loads(out.read_text())["step_spread"]["median_seconds"]
    return next(trace_dir.glob("*.json")), float(step)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.op_shares", description=__doc__)
    p.add_argument("--trace", nargs="*", help="summarise these trace files instead")
    p.add_argument("--workdir", help="scratch directory (default .pitstop-cache/bench/op_shares)")
    p.add_argument("--no-write", action="store_true", help="print the table only")
    p.add_argument("--out", help="the results file (default bench/results/op_shares.md)")
    args = p.parse_args(argv)
    if args.trace:
        runs = [(Path(t).parent.name, Path(t), None) for t in args.trace]
    else:
        workdir = Path(args.workdir or REPO_ROOT / ".pitstop-cache" / "bench" / "op_shares")
        runs = [(c, *profile(c, workdir)) for c in ("off", "on")]
    rows = []
    for label, trace, step in runs:
        times = self_times(trace)
        sh = shares(times)
        top = ", ".join(f"{n} {t:.2f} s" for n, t in times.most_common(4))
        rows.append([
            label, f"{step:.3f}" if step else "", f"{sum(times.values()):.2f}",
            *(f"{100 * sh[k]:.1f}%" for k in KINDS), top,
        ])  # fmt: skip
    headers = ["compile", "step s (median)", "op self time s", *KINDS, "largest ops"]
    table = markdown_table(headers, rows)
    print(table)
    if not args.no_write and not args.trace:
        notes = (
            "- Each row: `pitstop profile` of bench/compile_payoff.py's headline setup, 8 "
            "warm-up steps then 3 traced ones (torch.profiler slows the steps it records); "
            "self time of the CPU ops in the trace, summed by kind (the module docstring)."
        )
        body = "\n".join([table, "", "Notes:", "", notes])
        title = "Where a step's CPU time goes, eager and compiled (the bound on compile's gain)"
        path = write_result("op_shares", title, body, command=command_line(),
                            machine_info=machine(),
                            path=Path(args.out) if args.out else None)  # fmt: skip
        print(f"\n[op_shares] wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
