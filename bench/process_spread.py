"""Why two processes of one configuration train at different speeds (issue 32).

    .venv/bin/python -m bench.process_spread [--rounds 3] [--steps 12] [--jemalloc PATH]

On the 2-core development box two `pitstop train` processes of one configuration were seen
~10% apart in steady step time. This runs fresh processes of one training configuration
(the tiny Llama of bench/scale, 20,000 synthetic documents, `--max-seq-len 512
--tokens-per-step 8192`, default choices) under each condition below, interleaved round by
round so load that comes and goes hits them alike, and reports for each condition the
processes' steady trained tokens/s (the median over steps 3.., step 1-2 warm up) and their
spread (max / min - 1), beside the spread of steps within a process:

- `default`: as a user runs it;
- `no_loader_worker`: `--loader-workers 0`, so no reading process competes with the
  compute threads for the two cores;
- `pinned`: OpenMP threads bound to cores (OMP_PROC_BIND=close, OMP_PLACES=cores);
- `jemalloc`: glibc malloc replaced by jemalloc (LD_PRELOAD; only with --jemalloc or where
  the library is found);
- `flush_denormal`: torch.set_flush_denormal(True) before the run.

A condition that removes the cause shrinks the spread between its processes. To tell the
machine's own drift from the process's, each process is paired with a reference: the same
fixed torch matmul loop timed in a fresh process just before and just after it (its
operations per second, the mean of the two), and with the CPU time the hypervisor gave
other guests meanwhile (steal, /proc/stat). A spread that the reference shares is the
machine's; what remains after dividing by it is the process's. Writes
bench/results/process_spread.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import REPO_ROOT, markdown_table, write_result
from bench.scale import MSL, TPS, write_corpus

_DENORMAL = (
    "import sys, runpy, torch; torch.set_flush_denormal(True); "
    "sys.argv = ['pitstop', *sys.argv[1:]]; runpy.run_module('pitstop', run_name='__main__')"
)
JEMALLOC_PATHS = ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "/usr/lib64/libjemalloc.so.2")


def _conditions(jemalloc: str | None) -> dict[str, tuple[dict[str, str], list[str], list[str]]]:
    """name -> (extra environment, python arguments before the command, extra flags)."""
    py_m = ["-m", "pitstop"]
    out = {
        "default": ({}, py_m, []),
        "no_loader_worker": ({}, py_m, ["--loader-workers", "0"]),
        "pinned": ({"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}, py_m, []),
        "flush_denormal": ({}, ["-c", _DENORMAL], []),
    }
    if jemalloc:
        out["jemalloc"] = ({"LD_PRELOAD": jemalloc}, py_m, [])
    return out


# A fixed workload: torch matmuls of the tiny model's width, on the threads a run would use.
_REFERENCE = """
import time, torch
a, b = torch.randn(1024, 256), torch.randn(256, 1024)
for _ in range(20):
    a @ b
n, t = 0, time.perf_counter()
while time.perf_counter() - t < 1.5:
    a @ b
    n += 1
print(n / (time.perf_counter() - t))
"""


def _reference(py: str, env: dict[str, str]) -> float:
    """Matmuls per second of the reference loop, in a fresh process."""
    done = subprocess.run(
        [py, "-c", _REFERENCE], env=env, capture_output=True, text=True, check=True
    )
    return float(done.stdout.split()[-1])


def _cpu_ticks() -> tuple[int, int]:
    """(steal, all) CPU ticks so far, from /proc/stat (0, 0 where there is none)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return (fields[7] if len(fields) > 7 else 0), sum(fields)


def _steady(metrics: Path) -> tuple[float, float]:
    """(median trained tokens/s over steps 3.., relative spread of those steps)."""
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    rates = [r["step_trained_tokens"] / r["step_seconds"] for r in rows if r["step"] >= 3]
    med = statistics.median(rates)
    return med, (max(rates) / min(rates) - 1) if rates else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--docs", type=int, default=20_000)
    ap.add_argument("--jemalloc", help="path of libjemalloc.so.2 (default: the system's, if any)")
    args = ap.parse_args()
    jemalloc = args.jemalloc or next((p for p in JEMALLOC_PATHS if Path(p).exists()), None)
    from pitstop.tiny import build_model_dir

    py = sys.executable
    env = {
        **os.environ,
        "PITSTOP_PROGRESS": "0",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    conditions = _conditions(jemalloc)
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in conditions}
    machine: dict[str, list[tuple[float, float]]] = {k: [] for k in conditions}  # ref, steal
    with tempfile.TemporaryDirectory(prefix="pitstop-bench-spread-") as tmp:
        work = Path(tmp)
        model = build_model_dir(work / "model", layers=4, hidden=256, heads=4, vocab_size=4096)
        data = work / "docs.jsonl"
        write_corpus(data, args.docs)
        cache = work / "cache"
        subprocess.run(
            [
                py,
                "-m",
                "pitstop",
                "prepare",
                "--data",
                str(data),
                "--model",
                str(model),
                "--cache-dir",
                str(cache),
                "--max-seq-len",
                str(MSL),
                "--quiet",
            ],
            env=env,
            check=True,
        )
        for r in range(args.rounds):
            names = list(conditions)
            names = names[r % len(names) :] + names[: r % len(names)]  # a new first each round
            for name in names:
                extra_env, pre, flags = conditions[name]
                out = work / f"run-{name}-{r}"
                cmd = [
                    py,
                    *pre,
                    "train",
                    "--model",
                    str(model),
                    "--data",
                    str(data),
                    "--cache-dir",
                    str(cache),
                    "--output",
                    str(out),
                    "--max-seq-len",
                    str(MSL),
                    "--tokens-per-step",
                    str(TPS),
                    "--max-steps",
                    str(args.steps),
                    "--log-steps",
                    "1",
                    "--report-to",
                    "none",
                    *flags,
                ]
                before, (steal0, all0) = _reference(py, env), _cpu_ticks()
                done = subprocess.run(cmd, env={**env, **extra_env}, capture_output=True, text=True)
                steal1, all1 = _cpu_ticks()
                after = _reference(py, env)
                if done.returncode:
                    sys.exit(f"{name}: {' '.join(cmd)}\n{done.stderr[-3000:]}")
                results[name].append(_steady(out / "metrics.jsonl"))
                steal = (steal1 - steal0) / max(1, all1 - all0)
                machine[name].append(((before + after) / 2, steal))
                print(name, r, results[name][-1], machine[name][-1], flush=True)
    _report(results, machine, args, jemalloc)


def _spread(xs: list[float]) -> str:
    return f"{max(xs) / min(xs) - 1:.1%}"


def _report(
    results: dict[str, list[tuple[float, float]]],
    machine: dict[str, list[tuple[float, float]]],
    args: argparse.Namespace,
    jemalloc: str | None,
) -> None:
    rows = []
    every_rate, every_ref = [], []
    for name, runs in results.items():
        rates = [x for x, _ in runs]
        refs = [ref for ref, _ in machine[name]]
        every_rate += rates
        every_ref += refs
        relative = [x / ref for x, ref in zip(rates, refs, strict=True)]
        rows.append(
            [
                name,
                ", ".join(f"{x:,.0f}" for x in rates),
                f"{statistics.median(rates):,.0f}",
                _spread(rates),
                _spread(refs),
                _spread(relative),
                f"{statistics.median(s for _, s in runs):.1%}",
                f"{max(s for _, s in machine[name]):.1%}",
            ]
        )
    table = markdown_table(
        [
            "condition",
            "processes' steady trained tok/s",
            "median",
            "spread between processes",
            "spread of the reference beside them",
            "spread after dividing by the reference",
            "spread of steps within a process (median)",
            "steal (most)",
        ],
        rows,
    )
    ratio = [x / ref for x, ref in zip(every_rate, every_ref, strict=True)]
    body = (
        table
        + f"\n\nAll {len(every_rate)} processes: trained tok/s spread {_spread(every_rate)}; the "
        f"reference beside them {_spread(every_ref)}; tok/s over the reference "
        f"{_spread(ratio)}.\n\n{args.rounds} fresh `pitstop train` processes per condition, "
        f"interleaved round by round; tiny Llama (4 layers, width 256), {args.docs:,} synthetic "
        f"documents, `--max-seq-len {MSL} --tokens-per-step {TPS} --max-steps {args.steps}`; "
        "steady = the median over steps 3.. of trained tokens / step seconds (metrics.jsonl). "
        "Reference: a fixed torch matmul loop (1024x256 @ 256x1024) timed in a fresh process "
        "just before and just after each run, their mean. Steal: CPU time the hypervisor gave "
        f"other guests during the run (/proc/stat). jemalloc: {jemalloc or 'not found, not run'}.\n"
    )
    path = write_result("process_spread", "Process-to-process spread of steady step time", body)
    print(body)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
