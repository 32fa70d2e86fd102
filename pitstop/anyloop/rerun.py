"""`pitstop compare RUN_A RUN_B --rerun N`: settle a close call by alternating short runs.

Two runs made minutes apart on a shared machine differ by whatever else ran meanwhile.
Run alternately, A B A B …, the two commands see the same conditions in turn, so a
difference that shows in every pair is the change and not the machine. Only runs made by
`pitstop profile -- COMMAND` can be rerun: their summary.json records the command and
its working directory. Each pair is compared on steady throughput (pitstop.report.compare);
the verdict is "better" or "worse" only when every pair says so, else "no measurable
difference".
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from pitstop.anyloop.launch import run_command
from pitstop.core.errors import ConfigError, DataError
from pitstop.report.compare import NO_DIFFERENCE, compare
from pitstop.report.runs import LoadedRun, load_run

MAX_RERUNS = 20


def recorded_command(run: LoadedRun) -> tuple[list[str], str | None]:
    """(command, working directory) a run was made with; ConfigError when it has none."""
    cmd = run.summary.command  # a list of strings when present (RunSummary checks it)
    if not cmd:
        raise ConfigError(
            f"{run.path} records no command to rerun (only `pitstop profile -- COMMAND` runs "
            "do); make both runs that way, or follow the alternating recipe in docs/compare.md"
        )
    return cmd, run.summary.command_cwd


def rerun_pairs(
    run_a: str | Path, run_b: str | Path, n: int, output: str | Path | None = None
) -> list[tuple[Path, Path]]:
    """Run A's and B's commands alternately n times each; the (A_i, B_i) run directories."""
    if not 1 <= n <= MAX_RERUNS:
        raise ConfigError(f"--rerun takes 1 to {MAX_RERUNS} pairs, got {n}")
    ra, rb = load_run(run_a), load_run(run_b)
    (ca, wa), (cb, wb) = recorded_command(ra), recorded_command(rb)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out = Path(output) if output is not None else ra.path.parent / f"rerun-{stamp}"
    pairs = []
    for i in range(1, n + 1):
        made = []
        for side, cmd, cwd, src in (("a", ca, wa, ra), ("b", cb, wb, rb)):
            dest = (out / f"{i}-{side}").resolve()
            warm = (src.summary.profile or {}).get("warmup_steps")
            rc = run_command(cmd, dest, warmup_steps=int(warm or 1), cwd=cwd)
            if rc != 0:
                raise DataError(f"rerun {i} of {side.upper()} ({' '.join(cmd)}) exited with {rc}")
            made.append(dest)
        pairs.append((made[0], made[1]))
    return pairs


def settle(pairs: list[tuple[Path, Path]]) -> dict[str, Any]:
    """Per pair the steady tokens/s ratio B/A and its verdict; the verdict all pairs support."""
    rows = []
    for a, b in pairs:
        res = compare(a, b)
        tps = next(r for r in res["metrics"] if r["metric"] == "tokens_per_second")
        rows.append({"a": str(a), "b": str(b), "ratio": tps["ratio"], "verdict": tps["verdict"]})
    verdicts = {r["verdict"] for r in rows}
    verdict = verdicts.pop() if len(verdicts) == 1 and verdicts <= {"better", "worse"} else None
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
    return {
        "pairs": rows,
        "verdict": verdict or NO_DIFFERENCE,
        "median_ratio": statistics.median(ratios) if ratios else None,
        "ratio_range": [min(ratios), max(ratios)] if ratios else None,
    }


def format_settle(res: dict[str, Any]) -> str:
    """The pairs and the verdict they support, for a terminal."""
    n = len(res["pairs"])
    lines = [f"alternating reruns (A B A B ...), {n} pair(s): steady tokens/s B/A per pair"]
    for i, r in enumerate(res["pairs"], 1):
        ratio = f"{r['ratio']:.3f}x" if r["ratio"] is not None else "-"
        lines.append(f"  pair {i}: {ratio}  {r['verdict'] or '-'}")
    if res["median_ratio"] is not None:
        lo, hi = res["ratio_range"]
        lines.append(
            f"B/A tokens/s: median {res['median_ratio']:.3f}x (range {lo:.3f}-{hi:.3f}x) over "
            f"{n} pair(s): {res['verdict']}"
            + (
                ""
                if res["verdict"] != NO_DIFFERENCE
                else " (not every pair agrees beyond its band)"
            )
        )
    return "\n".join(lines)
