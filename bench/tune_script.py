"""`pitstop tune -- CMD` on the three scripts of issue 31: what each fix is worth, and how far
the doctor's prediction was from the measurement.

    .venv/bin/python -m bench.tune_script [--steps 6] [--budget-seconds 600] [--only NAME]

Scripts (a tiny Llama built with `pitstop.tiny.build_model_dir`, CPU):

- `loader`: examples/custom_loop.py --sleep 0.4 (seed-002 shape: batch 1, num_workers=0,
  a slow __getitem__); expected: the loader fix, measured >= 1.5x outside the band;
- `nothing`: examples/custom_loop.py --workers 2 (nothing to fix from outside); expected:
  "no change beats the noise";
- `trainer`: examples/hf_trainer_loop.py --sleep 0.05 (seed-000 shape: fp32, 0 workers,
  gradient checkpointing on, micro-batch 2 x accumulation 2); expected: workers,
  checkpointing off and the batch split measured one by one, bf16 only on a CPU with native
  bf16, the search within the default budget.

Trials run with OMP_NUM_THREADS=1 (set it to another value to measure with threads). Each
runs through the real CLI; the table lists every fix: the doctor's prediction, the
measured ratio with its band, the pairs measured, the verdict; and the whole search's seconds.
Writes bench/results/tune_script.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One OpenMP thread per trial: on 2 shared cores the script's OpenMP threads and its loader
# workers oversubscribe the cores and some trials' compute ran 10x slower (docs/tune.md).
os.environ.setdefault("OMP_NUM_THREADS", "1")

from bench.common import markdown_table, write_result

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SCRIPTS = {
    "loader": ("custom_loop.py", ["--sleep", "0.4", "--steps", "1000"]),
    "nothing": ("custom_loop.py", ["--workers", "2", "--steps", "1000"]),
    "trainer": ("hf_trainer_loop.py", ["--sleep", "0.05", "--steps", "1000"]),
}


def _one(name: str, model: Path, work: Path, steps: int, budget: float) -> tuple[list, float]:
    from pitstop import cli
    from pitstop.tune.script import TUNED

    script, args = SCRIPTS[name]
    out = work / name
    extra = ["--output-dir", str(work / f"{name}-user")] if name == "trainer" else []
    argv = ["tune", "--output", str(out), "--steps", str(steps), "--budget-seconds", str(budget)]
    t = time.monotonic()
    rc = cli.main([*argv, "--", sys.executable, str(EXAMPLES / script), str(model), *args, *extra])
    seconds = time.monotonic() - t
    if rc != 0:
        return [[name, "(the tune failed)", "", "", "", "", ""]], seconds
    res = json.loads((out / TUNED).read_text())
    rows = []
    results = res["results"] + ([res["combined"]] if res["combined"] else [])
    seen = set()
    for r in results:
        if r["fix"] in seen:  # the combination of one fix is that fix
            continue
        seen.add(r["fix"])
        j = r["judgement"]
        measured = f"{j['ratio']:.2f}× [{j['low']:.2f}–{j['high']:.2f}]" if j else "—"
        rows.append(
            [name, r["fix"], r["predicted"], measured, r["rounds"], r["verdict"], r["math"]]
        )
    for n in res["not_tried"]:
        rows.append([name, n["fix"], "—", "not tried", 0, n["reason"][:60], ""])
    rows.append([name, "recommended", "", res["code"] or "no change beats the noise", "", "", ""])
    return rows, seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="measured steps per trial (6)")
    ap.add_argument("--budget-seconds", type=float, default=600.0, help="per script (600)")
    ap.add_argument("--only", choices=sorted(SCRIPTS), action="append", help="run only these")
    a = ap.parse_args(argv)
    from pitstop.tiny import build_model_dir

    rows: list[list] = []
    times = []
    with tempfile.TemporaryDirectory(prefix="pitstop-bench-tune-script-") as tmp:
        work = Path(tmp)
        model = work / "model"
        build_model_dir(model)
        for name in a.only or list(SCRIPTS):
            got, seconds = _one(name, model, work, a.steps, a.budget_seconds)
            rows += got
            times.append([name, f"{seconds:.0f}"])
            print(f"{name}: {seconds:.0f} s", flush=True)
    body = "\n\n".join(
        [
            markdown_table(
                ["script", "fix", "predicted", "measured (band)", "pairs", "verdict", "math"], rows
            ),
            "Whole search per script (seconds, baseline and every trial included):",
            markdown_table(["script", "seconds"], times),
        ]
    )
    path = write_result("tune_script", "pitstop tune -- CMD on issue 31's scripts", body)
    print(body)
    print(f"\nwritten to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
