"""Run every benchmark in ``bench/`` (what ``make bench`` does) and summarise which passed.

Each module ``bench/X.py`` that has a ``main`` is run as its own subprocess,
``python -m bench.X``, in a fixed order (headline first, then prepare, batching,
train, estimate, tune, then any others alphabetically), so one benchmark's
imports, threads and memory never leak into the next. A failure or a timeout is
recorded and the run goes on. Each benchmark writes its own
``bench/results/NAME.md``; this writes ``bench/results/summary.md``: per
benchmark, the status, the seconds it took, and the results files it wrote.

Usage:
    python -m bench.run_all                       # everything
    python -m bench.run_all --only headline,train
    python -m bench.run_all --skip headline --timeout 1200
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.common import (
    BENCH_DIR,
    REPO_ROOT,
    RESULTS_DIR,
    command_line,
    markdown_table,
    write_result,
)

ORDER = ("headline", "prepare", "batching", "train", "estimate", "tune")
NOT_BENCHMARKS = {"__init__", "common", "run_all", "gpu_wheels"}  # gpu_wheels: a tool
ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
}


def discover(bench_dir: Path = BENCH_DIR) -> list[str]:
    """Benchmark module names present in `bench_dir`, in run order."""
    names = [
        p.stem
        for p in bench_dir.glob("*.py")
        if p.stem not in NOT_BENCHMARKS and not p.stem.startswith("_")
    ]
    known = [n for n in ORDER if n in names]
    return known + sorted(n for n in names if n not in ORDER)


def run_one(name: str, timeout: float, log_dir: Path) -> tuple[str, float, str]:
    """Run ``python -m bench.NAME``; (status, seconds, last lines of output on failure)."""
    log = log_dir / f"{name}.log"
    cmd = [sys.executable, "-m", f"bench.{name}"]
    t0 = time.perf_counter()
    with open(log, "w", encoding="utf-8") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        # Output is teed through us so a long `make bench` shows progress.
        proc = subprocess.Popen(
            cmd,
            cwd=REPO_ROOT,
            env={**os.environ, **ENV},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
        assert proc.stdout is not None
        deadline = t0 + timeout
        timed_out = False
        for line in proc.stdout:
            f.write(line)
            sys.stdout.write(f"[{name}] {line}")
            sys.stdout.flush()
            if time.perf_counter() > deadline:
                timed_out = True
                break
        if timed_out:
            proc.kill()
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc, timed_out = proc.wait(), True
    seconds = time.perf_counter() - t0
    if timed_out:
        return "timed out", seconds, f"killed after {timeout:.0f} s"
    if rc != 0:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        return f"failed (exit {rc})", seconds, " / ".join(lines[-3:])[-400:]
    return "passed", seconds, ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.run_all", description=__doc__.split("\n")[0])
    p.add_argument("--only", help="comma-separated benchmark names to run")
    p.add_argument("--skip", help="comma-separated benchmark names not to run")
    p.add_argument(
        "--timeout", type=float, default=2400, help="seconds per benchmark (default 2400)"
    )
    args = p.parse_args(argv)
    names = discover()
    if args.only:
        wanted = args.only.split(",")
        missing = [n for n in wanted if n not in names]
        if missing:
            print(f"no benchmark named {', '.join(missing)}; present: {', '.join(names)}")
            return 2
        names = [n for n in names if n in wanted]
    if args.skip:
        names = [n for n in names if n not in args.skip.split(",")]
    log_dir = REPO_ROOT / ".pitstop-cache" / "bench" / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)

    rows = []
    failed = 0
    t_all = time.perf_counter()
    for name in names:
        before = {q: q.stat().st_mtime for q in RESULTS_DIR.glob("*.md")}
        print(f"=== bench.{name} ===", flush=True)
        status, seconds, why = run_one(name, args.timeout, log_dir)
        written = sorted(
            q.name
            for q in RESULTS_DIR.glob("*.md")
            if q.name != "summary.md" and before.get(q) != q.stat().st_mtime
        )
        failed += status != "passed"
        rows.append([name, status, f"{seconds:.0f}", ", ".join(written) or "—", why or "—"])
        print(f"=== bench.{name}: {status} in {seconds:.0f} s ===", flush=True)

    table = markdown_table(["benchmark", "status", "seconds", "results written", "detail"], rows)
    total = time.perf_counter() - t_all
    body = (
        f"{table}\n\n{len(names) - failed} of {len(names)} benchmarks passed in {total:.0f} s. "
        f"Logs: `.pitstop-cache/bench/logs/NAME.log`."
    )
    print()
    print(table)
    path = write_result(
        "summary", "Benchmarks: summary of the last `make bench`", body, command=command_line()
    )
    print(f"\n{len(names) - failed}/{len(names)} passed; wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
