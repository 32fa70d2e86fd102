"""What keeping freed host memory pays on the headline model: `pitstop train
--keep-freed-memory off` against `on` (the CPU default), interleaved.

glibc hands large freed blocks back to the OS, and a CPU training step then faults the same
tensors' pages in again every step (pitstop/core/host_malloc.py). Each run here is a whole
`pitstop train` process of the headline model (bench/headline.py's CPU setup: a 4-layer,
256-wide Llama, 8k vocabulary, rows of 1024, 4,096 tokens a step, sdpa_docs, compile off),
with a fresh cache directory, for the same number of steps, alternating off/on, then on/off.

Reported per run and as medians: trained tokens/s on the train clock and over the whole
process, the minor page faults per step after the first (summary.json, counted by the
kernel: getrusage), and the peak resident memory at the first logged step and at the end
(metrics.jsonl's `peak_memory_gib`, summary.json's `peak_memory_bytes`): kept memory must
not grow the peak as the run goes on.

Then the doctor's explanation against a second run without its cause: `pitstop profile --
python examples/faulting_loop.py` (a plain loop whose 32 MiB logits glibc hands back every
step) with glibc's defaults and with the `host-page-faults` finding's fix in its environment,
interleaved: the share of the step the finding says the faults cost, against the step-time
saving the second run measured (medians of the profiles' steps).

Usage:
    python -m bench.host_malloc                 # 2 pairs of 120 steps (about 20 minutes)
    python -m bench.host_malloc --pairs 1 --steps 40
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import REPO_ROOT, command_line, describe_machine, markdown_table, write_result
from bench.compile_payoff import headline_setup
from bench.headline import Setup, _pitstop_flags, _spawn, _tail

STEADY_FROM = 5  # the steady step: the median after the first 5 (the heap settles in them)
HEADERS = [
    "keep freed memory", "trained tok/s (train)", "trained tok/s (whole process)",
    "steady step s (median)",
    "page faults / step", "peak memory GiB (first log / end)", "other processes (cores)",
]  # fmt: skip


def run_pitstop(setup: Setup, out: Path, keep: str, steps: int, timeout: int) -> dict[str, Any]:
    """One `pitstop train` process with a fresh cache directory; its summary and clocks."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pitstop", "train", *_pitstop_flags(setup, out / "cache")]
    cmd += ["--output", str(out / "run"), "--compile", "off", "--max-steps", str(steps)]
    cmd += ["--keep-freed-memory", keep, "--log-steps", "10", "--report-to", "none"]
    print(f"[host_malloc] keep_freed_memory {keep}: {steps} steps", flush=True)
    sp = _spawn(cmd, out / "log.txt", timeout)
    path = out / "run" / "summary.json"
    if sp.rc != 0 or not path.is_file():
        raise SystemExit(
            f"pitstop train --keep-freed-memory {keep} failed: {_tail(out / 'log.txt')}"
        )
    s = json.loads(path.read_text())
    lines = (out / "run" / "metrics.jsonl").read_text().splitlines()
    metrics = [json.loads(x) for x in lines]
    peaks = [m["peak_memory_gib"] for m in metrics if "peak_memory_gib" in m]
    steady = [m["step_seconds"] for m in metrics[STEADY_FROM:] if m.get("step_seconds")]
    return {
        "keep": keep,
        "kept": (s.get("choices") or {}).get("host_memory", {}).get("value"),
        "tok_s": s["trained_tokens"] / s["train_seconds"],
        "whole_tok_s": s["trained_tokens"] / sp.seconds,
        "faults": s.get("host_page_faults_per_step"),
        "step": statistics.median(steady) if steady else None,
        "peak_first": peaks[0] if peaks else None,
        "peak_end": s["peak_memory_bytes"] / 2**30,
        "others_cores": sp.others_cores,
    }


def profile_script(workdir: Path, name: str, keep: bool, steps: int) -> dict[str, Any]:
    """`pitstop profile -- python examples/faulting_loop.py`, with the finding's fix in the
    environment when `keep`; the median step, the faults and the finding's share."""
    from pitstop.core.host_malloc import KEEP_ENV

    out = workdir / name
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, **KEEP_ENV} if keep else None
    loop = [sys.executable, str(REPO_ROOT / "examples" / "faulting_loop.py"), "--steps", str(steps)]
    cmd = [sys.executable, "-m", "pitstop", "profile", "--output", str(out), "--", *loop]
    print(f"[host_malloc] faulting_loop.py, memory {'kept' if keep else 'default'}", flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"pitstop profile failed: {r.stderr[-2000:]}")
    prof = json.loads((out / "pitstop_profile.json").read_text())
    found = json.loads((out / "findings.json").read_text())["findings"]
    share = next((f["gain"] for f in found if f["id"] == "host-page-faults"), None)
    return {
        "keep": keep,
        "step": statistics.median(prof["step_seconds"]),
        "faults": prof.get("host_page_faults_per_step"),
        "fault_us": (prof.get("page_fault_seconds") or 0) * 1e6,
        "share": share,
    }


def script_findings(runs: list[dict[str, Any]]) -> list[str]:
    default = [r for r in runs if not r["keep"]]
    kept = [r for r in runs if r["keep"]]
    step_d = statistics.median(r["step"] for r in default)
    step_k = statistics.median(r["step"] for r in kept)
    shares = [r["share"] for r in default if r["share"] is not None]
    said = f"{statistics.median(shares):.1%}" if shares else "no finding"
    return [
        f"- glibc's defaults: median step {step_d * 1e3:.1f} ms, "
        f"{statistics.median(r['faults'] for r in default):,.0f} page faults a step at "
        f"{statistics.median(r['fault_us'] for r in default):.2f} us each; the doctor's "
        f"`host-page-faults` finding: {said} of the step "
        f"({sum(1 for r in default if r['share'] is not None)} of {len(default)} profiles)",
        f"- the finding's fix in the environment: median step {step_k * 1e3:.1f} ms, "
        f"{statistics.median(r['faults'] for r in kept):,.0f} page faults a step, finding in "
        f"{sum(1 for r in kept if r['share'] is not None)} of {len(kept)} profiles",
        f"- measured saving {1 - step_k / step_d:.1%} of the step, against the finding's {said}",
    ]


def summarize(runs: list[dict[str, Any]]) -> tuple[list[list[str]], list[str]]:
    rows = [
        [
            r["keep"], f"{r['tok_s']:,.0f}", f"{r['whole_tok_s']:,.0f}",
            f"{r['step']:.3f}" if r["step"] else "n/a",
            f"{r['faults']:,.0f}" if r["faults"] is not None else "n/a",
            f"{r['peak_first']:.3f} / {r['peak_end']:.3f}" if r["peak_first"] else "n/a",
            f"{r['others_cores']:.2f}" if r.get("others_cores") is not None else "n/a",
        ]
        for r in runs
    ]  # fmt: skip

    def med(keep: str, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["keep"] == keep)

    findings = [
        f"- kept: trained tokens/s {med('on', 'tok_s') / med('off', 'tok_s'):.2f}x glibc's "
        f"defaults on the train clock, {med('on', 'whole_tok_s') / med('off', 'whole_tok_s'):.2f}x"
        " over the whole process (medians)",
        f"- the steady step (the median after the first {STEADY_FROM}): "
        f"{med('off', 'step'):.3f} s with glibc's defaults, {med('on', 'step'):.3f} s kept: "
        f"{med('off', 'step') / med('on', 'step'):.2f}x",
        f"- page faults per step: {med('off', 'faults'):,.0f} with glibc's defaults, "
        f"{med('on', 'faults'):,.0f} kept",
        f"- peak resident memory at the end: {med('off', 'peak_end'):.3f} GiB with glibc's "
        f"defaults, {med('on', 'peak_end'):.3f} GiB kept "
        f"({med('on', 'peak_end') / med('off', 'peak_end') - 1:+.1%})",
    ]
    return rows, findings


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.host_malloc", description=__doc__)
    p.add_argument("--pairs", type=int, default=2, help="off/on pairs (default 2)")
    p.add_argument("--steps", type=int, default=120, help="optimizer steps per run")
    p.add_argument("--script-steps", type=int, default=40, help="steps of faulting_loop.py")
    p.add_argument("--workdir", help="scratch directory (default .pitstop-cache/bench/...)")
    p.add_argument("--out", help="results file (default bench/results/host_malloc.md)")
    p.add_argument("--no-write", action="store_true", help="print the table only")
    args = p.parse_args(argv)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU benchmark
    workdir = Path(args.workdir or REPO_ROOT / ".pitstop-cache" / "bench" / "host_malloc")
    t0 = time.perf_counter()
    setup = headline_setup(workdir)
    runs = []
    for i in range(args.pairs):
        for keep in ("off", "on") if i % 2 == 0 else ("on", "off"):
            runs.append(run_pitstop(setup, workdir / f"{keep}-{i}", keep, args.steps, 3600))
    rows, findings = summarize(runs)
    script = []
    for i in range(args.pairs):
        for keep in (False, True) if i % 2 == 0 else (True, False):
            name = f"script-{'kept' if keep else 'default'}-{i}"
            script.append(profile_script(workdir, name, keep, args.script_steps))
    findings += [
        "",
        "The doctor's explanation of a script, against a second run without the cause:",
        "",
    ]
    findings += script_findings(script)
    notes = [
        f"- Each run: `pitstop train` of the headline model, {args.steps} steps of "
        f"{setup.tokens_per_step:,} tokens (rows of {setup.max_len}), compile off, a fresh "
        f"cache directory; {args.pairs} pair(s) interleaved, medians over the pairs.",
        f"- {describe_machine()}; the whole benchmark took {time.perf_counter() - t0:.0f} s. "
        "Other processes' CPU while each run ran is in the last column: above 0.25 cores the "
        "timings are noisy.",
    ]
    body = "\n".join(
        [markdown_table(HEADERS, rows), "", "Findings:", "", *findings, "", "Notes:", "", *notes]
    )
    print(body)
    if not args.no_write:
        title = "Keeping freed host memory on the headline model (pitstop train, CPU)"
        path = write_result("host_malloc", title, body, command=command_line(),
                            path=Path(args.out) if args.out else None)  # fmt: skip
        print(f"\n[host_malloc] wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
