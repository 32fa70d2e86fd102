"""Run a test directory several times in a row while busy loops keep every core busy.

The reliability suite must not depend on how fast the machine is (docs/fault-injection.md):
its kills and signals land at named fault points, not at clock guesses. This script is the
check of that claim, and the command behind the number in the notes:

    python scripts/under_load.py                 # tests/reliability, 20 passes, a hog per core
    make soak-load RUNS=20                       # the same through the Makefile's venv

Each pass runs `python -m pytest -p no:cacheprovider -n 2 -q <paths>` (as `make test` runs
it: 2 workers; xdist hands each test to whichever worker is free, so which tests share a
worker changes from pass to pass), so with one hog per core the machine holds at least twice
as many busy processes as cores. It stops at the first failed
pass, prints one line per pass (seconds, pytest's last line, the load average) and a final
"K of N passed in a row", and exits non-zero unless every pass passed. Each pass's whole
output is kept in --log-dir.

Written by hand: pytest-repeat and pytest-flakefinder repeat tests inside one session,
which shares fixtures and the worker processes between passes; this runs each pass as a
fresh session, as CI does.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HOG = "while True: pass"
_CAPTURE = {"capture_output": True, "text": True, "check": True}


def start_hogs(n: int) -> list[subprocess.Popen]:
    """`n` single-threaded busy loops (one core each)."""
    return [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(n)]


def stop_hogs(hogs: list[subprocess.Popen]) -> None:
    for h in hogs:
        h.kill()
    for h in hogs:
        h.wait()


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:  # not available on this platform
        return "?"


def revision() -> str:
    try:
        git = ["git", "-C", str(REPO)]
        out = subprocess.run([*git, "rev-parse", "--short", "HEAD"], **_CAPTURE)
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], **_CAPTURE)
    except (OSError, subprocess.CalledProcessError):
        return "(not a git checkout)"
    return out.stdout.strip() + (" with uncommitted changes" if dirty.stdout.strip() else "")


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="*", default=["tests/reliability"], help="what pytest runs")
    ap.add_argument("--runs", type=int, default=20, help="passes wanted in a row (default 20)")
    ap.add_argument(
        "--hogs",
        type=int,
        default=os.cpu_count() or 1,
        help="busy-loop processes beside the tests (default: one per core)",
    )
    ap.add_argument("--workers", default="2", help="pytest-xdist workers, as `make test` (2)")
    ap.add_argument("--log-dir", type=Path, default=Path("under-load-logs"))
    args = ap.parse_args(argv)
    if args.runs < 1 or args.hogs < 0:
        ap.error("--runs must be at least 1 and --hogs at least 0")
    args.log_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", args.workers, "-q"]
    cmd += args.paths
    rev = revision()
    print(f"{' '.join(cmd[1:])}: {args.runs} passes wanted, {args.hogs} busy loop(s), at {rev}")
    passed = 0
    hogs = start_hogs(args.hogs)
    try:
        for i in range(1, args.runs + 1):
            t0 = time.monotonic()
            done = subprocess.run(cmd, capture_output=True, text=True)
            secs = time.monotonic() - t0
            log = args.log_dir / f"pass-{i}.txt"
            log.write_text(done.stdout + done.stderr, encoding="utf-8")
            verdict = "passed" if done.returncode == 0 else f"FAILED (exit {done.returncode})"
            print(
                f"pass {i}: {verdict} in {secs:.0f} s: {last_line(done.stdout)} "
                f"(load average {load_average()}; output in {log})",
                flush=True,
            )
            if done.returncode != 0:
                break
            passed += 1
    finally:
        stop_hogs(hogs)
    print(f"{passed} of {args.runs} passed in a row at {rev}")
    return 0 if passed == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
