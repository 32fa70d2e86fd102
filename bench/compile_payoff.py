"""What torch.compile pays on the headline model: eager against compiled `pitstop train`,
interleaved, and the payoff model's prediction against what the runs measured (issue 46).

Each run is a whole `pitstop train` process of the headline model (bench/headline.py's CPU
setup: a 4-layer, 256-wide Llama, 8k vocabulary, rows of 1024, 4,096 tokens a step,
sdpa_docs) over every training chapter, for the same number of steps: `--compile off`
against `--compile on`, alternating (off/on, then on/off, ...), each with a fresh cache
directory, so every compiled run pays a cold compile (inductor's caches under it) and
measures compile's cost and gain on its steps as any first compiled run does. The step count
is chosen from a short eager calibration run so that each run trains about `--minutes`.

Reported, medians over the pairs: trained tokens/s on the train clock and over the whole
process (start to final model saved, the compile included), the compiled/eager ratios, the
compile time and step times pitstop measured (summary.json: choices.compile.measured), what
`compile: auto` would decide for a run of that length, and the payoff model's prediction
of the train-clock saving (the compiled run's eager measuring steps, the compile, then
compiled steps, against every step eager) against the saving the runs measured.

Usage:
    python -m bench.compile_payoff              # 3 pairs of ~10-minute runs (about an hour)
    python -m bench.compile_payoff --short      # the quick model, 1 pair of 24 steps (minutes)
    python -m bench.compile_payoff --pairs 2 --minutes 5

Timings are only as good as the machine is quiet: the report gives the CPU other processes
used while each run ran (bench.headline's witness).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import (
    REPO_ROOT,
    RESULTS_DIR,
    command_line,
    describe_machine,
    machine,
    markdown_table,
    write_result,
)
from bench.headline import CPU_FULL, CPU_QUICK, Setup, _pitstop_flags, _spawn, _tail, build_setup

GOAL_TRAIN = 1.2  # compiled train tokens/s over eager
GOAL_WHOLE = 1.1  # compiled whole-process tokens/s over eager, the compile included
GOAL_PREDICTION = 0.25  # the payoff model's predicted saving within this of the measured
SLOW_STEP = 5.0  # a step this many times the run's median is reported (a compile)


def run_pitstop(setup: Setup, out: Path, compile_: str, steps: int, timeout: int) -> dict[str, Any]:
    """One `pitstop train` process with a fresh cache directory; its summary and clocks."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cache = out / "cache"
    cmd = [sys.executable, "-m", "pitstop", "train", *_pitstop_flags(setup, cache)]
    cmd += ["--output", str(out / "run"), "--compile", compile_, "--max-steps", str(steps)]
    cmd += ["--log-steps", "50", "--report-to", "none"]
    print(f"[compile_payoff] {compile_}: {steps} steps", flush=True)
    sp = _spawn(cmd, out / "log.txt", timeout)
    path = out / "run" / "summary.json"
    if sp.rc != 0 or not path.is_file():
        raise SystemExit(f"pitstop train --compile {compile_} failed: {_tail(out / 'log.txt')}")
    s = json.loads(path.read_text())
    choice = (s.get("choices") or {}).get("compile") or {}
    lines = (out / "run" / "metrics.jsonl").read_text().splitlines()
    seconds = {r["step"]: r["step_seconds"] for r in map(json.loads, lines)}
    typical = statistics.median(seconds.values())
    return {
        "compile": compile_,
        "trained_tokens": s["trained_tokens"],
        "train_seconds": s["train_seconds"],
        "wall_seconds": sp.seconds,
        "others_cores": sp.others_cores,
        "steps": s.get("optimizer_steps"),
        "compiled": choice.get("value"),
        "measured": (choice.get("measured") or {}).get("measured"),
        # Compiles show as steps far above the median: the first compiled one, and any
        # recompile (a micro-batch shape the first graph did not take).
        "slow_steps": {k: v for k, v in seconds.items() if v > SLOW_STEP * typical},
    }


def calibrate(setup: Setup, workdir: Path, timeout: int) -> float:
    """Trained tokens per second of a short eager run (the step count's basis)."""
    r = run_pitstop(setup, workdir / "calibrate", "off", 8, timeout)
    return r["trained_tokens"] / r["train_seconds"]


def predicted_saving(measured: dict[str, Any], steps: int) -> float:
    """The payoff model's train-clock saving of a compiled run over an eager one of `steps`:
    the compiled run's measuring steps that run eagerly (pitstop.train.compile_record
    `eager_steps`: the first, then twos between compiled ones), the compile, and
    compiled steps; one compile, whatever the micro-batches' row counts."""
    from pitstop.train.compile_record import eager_steps

    eager, compiled = measured["eager_step_seconds"], measured["compiled_step_seconds"]
    n_eager = eager_steps(steps)
    compiled_run = n_eager * eager + measured["compile_seconds"]
    compiled_run += (steps - n_eager) * compiled
    return steps * eager - compiled_run


def summarize(runs: list[dict[str, Any]], steps: int) -> tuple[list[list[str]], list[str]]:
    rows = []
    for r in runs:
        m = r.get("measured") or {}
        rows.append([
            r["compile"], f"{r['trained_tokens'] / r['train_seconds']:,.0f}",
            f"{r['trained_tokens'] / r['wall_seconds']:,.0f}",
            f"{r['train_seconds']:.0f} / {r['wall_seconds']:.0f}",
            f"{m['compile_seconds']:.1f}" if m else "",
            f"{m['eager_step_seconds']:.3f} / {m['compiled_step_seconds']:.3f} "
            f"({m.get('pairs', 0)} pairs; {m.get('speedup_floor', 0):.2f}x at 90%)" if m else "",
            ", ".join(f"{k}: {v:.1f} s" for k, v in r.get("slow_steps", {}).items()) or "none",
            f"{r['others_cores']:.2f}" if r.get("others_cores") is not None else "n/a",
        ])  # fmt: skip
    by = {c: [r for r in runs if r["compile"] == c] for c in ("off", "on")}

    def med(c: str, key: str) -> float:
        return statistics.median(r["trained_tokens"] / r[key] for r in by[c])

    train_x = med("on", "train_seconds") / med("off", "train_seconds")
    whole_x = med("on", "wall_seconds") / med("off", "wall_seconds")
    saving = statistics.median(r["train_seconds"] for r in by["off"]) - statistics.median(
        r["train_seconds"] for r in by["on"]
    )
    facts = [r["measured"] for r in by["on"] if r.get("measured")]
    goals = [
        f"- compiled train tokens/s {train_x:.2f}x eager (goal >= {GOAL_TRAIN}x: "
        f"{'met' if train_x >= GOAL_TRAIN else 'NOT met'})",
        f"- compiled whole-process tokens/s {whole_x:.2f}x eager, the compile included (goal >= "
        f"{GOAL_WHOLE}x: {'met' if whole_x >= GOAL_WHOLE else 'NOT met'})",
    ]
    if facts:
        pred = statistics.median(predicted_saving(m, steps) for m in facts)
        err = abs(pred - saving) / abs(saving) if saving else math.inf
        goals.append(
            f"- the payoff model predicted a train-clock saving of {pred:.0f} s; the runs "
            f"measured {saving:.0f} s (medians): {err:.0%} off (goal within "
            f"{GOAL_PREDICTION:.0%}: {'met' if err <= GOAL_PREDICTION else 'NOT met'})"
        )
        goals.append(clock_line(by, pred))
        goals.append(f"- {auto_decision(facts[0], steps)}")
    return rows, goals


def clock_line(by: dict[str, list[dict[str, Any]]], pred: float) -> str:
    """The same prediction as a compiled run's train clock: a saving near zero makes any
    error a large share of it, so the clock's error, beside how far apart the eager runs
    themselves are, says how good the prediction is for what a user pays."""
    off = [r["train_seconds"] for r in by["off"]]
    on = statistics.median(r["train_seconds"] for r in by["on"])
    want = statistics.median(off) - pred
    spread = (max(off) - min(off)) / statistics.median(off)
    return (
        f"- as a compiled run's train clock: predicted {want:.0f} s, measured {on:.0f} s "
        f"({abs(want - on) / on:.1%} off); the eager runs differ by {spread:.1%} among "
        "themselves"
    )


def auto_decision(facts: dict[str, Any], steps: int) -> str:
    """What `compile: auto` decides for a run of `steps` with this measurement."""
    from pitstop.probe import CompileSpeed, DeviceInfo, choose_compile

    speed = CompileSpeed(
        facts["compile_seconds"], facts["eager_step_seconds"], facts["compiled_step_seconds"],
        "measured by these runs", tuple(facts.get("ratios", ())),
    )  # fmt: skip
    cpu = DeviceInfo("cpu", "cpu")
    choice = choose_compile("auto", cpu, None, steps=steps, measured=speed)
    short = choose_compile("auto", cpu, None, steps=max(1, steps // 20), measured=speed)
    return (
        f"compile: auto for a run of {steps} steps: {'compile' if choice.value else 'eager'} "
        f"({choice.reason}); for {max(1, steps // 20)} steps: "
        f"{'compile' if short.value else 'eager'}"
    )


def headline_setup(workdir: Path, *, short: bool = False) -> Setup:
    """bench/headline.py's CPU setup (the quick one with `short`), built in `workdir`."""
    sizes = CPU_QUICK if short else CPU_FULL
    workdir.mkdir(parents=True, exist_ok=True)
    ns = argparse.Namespace(
        seed=0, data_seed=1234, lr=None, gpu=False, quick=short, vocab=None,
        train_chapters=sizes.train_chapters if short else 10_000,
    )  # fmt: skip
    return build_setup(ns, sizes, workdir)


HEADERS = [
    "compile", "trained tok/s (train)", "trained tok/s (whole process)", "train / whole s",
    "compile s (measured)", "step s eager / compiled (measured)",
    f"steps over {SLOW_STEP:g}x the median", "other processes (cores)",
]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compile_payoff", description=__doc__)
    p.add_argument("--short", action="store_true", help="the quick model, 1 pair of 24 steps")
    p.add_argument("--pairs", type=int, help="eager/compiled pairs (default 3; --short 1)")
    p.add_argument("--minutes", type=float, default=10.0, help="training minutes per run")
    p.add_argument("--steps", type=int, help="steps per run (default: from --minutes)")
    p.add_argument("--workdir", help="scratch directory (default .pitstop-cache/bench/...)")
    p.add_argument("--out", help="results file (default bench/results/compile_payoff[-short].md)")
    p.add_argument("--no-write", action="store_true", help="print the table only")
    args = p.parse_args(argv)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU benchmark: no child may pick up a GPU
    suffix = "-short" if args.short else ""
    workdir = Path(args.workdir or REPO_ROOT / ".pitstop-cache" / "bench" / f"compile{suffix}")
    t0 = time.perf_counter()
    setup = headline_setup(workdir, short=args.short)
    timeout = 4 * 3600
    steps = args.steps or (24 if args.short else 0)
    if not steps:
        tps = calibrate(setup, workdir, timeout)
        steps = math.ceil(args.minutes * 60 * tps / setup.tokens_per_step)
        print(f"[compile_payoff] eager calibration: {tps:,.0f} tok/s -> {steps} steps", flush=True)
    pairs = args.pairs or (1 if args.short else 3)
    runs = []
    for i in range(pairs):
        for c in ("off", "on") if i % 2 == 0 else ("on", "off"):
            runs.append(run_pitstop(setup, workdir / f"{c}-{i}", c, steps, timeout))
    rows, goals = summarize(runs, steps)
    info = machine()
    table = markdown_table(HEADERS, rows)
    from pitstop.train.compile_record import eager_steps

    notes = [
        f"Model: {setup.model_desc}; {setup.notes[0]}.",
        f"Each run: `pitstop train` defaults, {steps} steps of {setup.tokens_per_step:,} tokens "
        f"(rows of {setup.max_len}), a fresh cache directory (a cold compile), {pairs} "
        "pair(s) interleaved; medians over the pairs.",
        "The compiled runs run their first step and, in twos between compiled ones, "
        f"{eager_steps(steps) - 1} more eagerly (pitstop times compile's cost on its first "
        "compiled step and its gain as the second eager step of each two against the "
        "compiled steps around them): the "
        "measured columns are pitstop's own record, the one the payoff model predicts from "
        "and the next run of the configuration decides with.",
        f"Machine: {describe_machine(info)}; the whole benchmark took "
        f"{time.perf_counter() - t0:.0f} s. Other processes' CPU while each run ran is in "
        "the last column: above 0.25 cores the timings are noisy.",
    ]
    body = "\n".join(
        [table, "", "Goals:", "", *goals, "", "Notes:", "", *[f"- {n}" for n in notes]]
    )
    print(table, "\n", "\n".join(goals), sep="\n")
    if not args.no_write:
        out = Path(args.out) if args.out else RESULTS_DIR / f"compile_payoff{suffix}.md"
        title = "torch.compile's payoff on the headline model (pitstop train, eager vs compiled)"
        path = write_result("compile_payoff", title, body, command=command_line(),
                            machine_info=info, path=out)  # fmt: skip
        print(f"\n[compile_payoff] wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
