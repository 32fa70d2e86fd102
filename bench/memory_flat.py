"""Memory over a long run: resident memory at step 100 against step 2,000 (issue 32).

    .venv/bin/python -m bench.memory_flat [--steps 2000] [--at 100]

A small Llama (2 layers, width 64) trains on the bundled corpus for `--steps` optimizer
steps in this process (512 tokens per step, rows of 128, several epochs), with the
trainer's step hooks (pitstop/train/hooks.py) reading the process's resident memory
(psutil) and its peak so far (getrusage) after step `--at` and after the last step.
The loader and the trainer must hold no state that grows per step: the issue's bound is
the peak at the end within 5% of the peak at step 100. Writes
bench/results/memory_flat.md.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
from pathlib import Path

import psutil

from bench.common import markdown_table, write_result


class RssAt:
    """Step hooks recording memory after chosen steps (1-based)."""

    def __init__(self, at: set[int]) -> None:
        self.at = at
        self.rows: list[tuple[int, float, float]] = []
        self.proc = psutil.Process()

    def step_started(self) -> bool:
        return False

    def step_ended(self, step: int) -> None:
        done = step + 1
        if done in self.at:
            rss = self.proc.memory_info().rss / 2**20
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
            self.rows.append((done, rss, peak))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--at", type=int, default=100)
    args = ap.parse_args()
    from pitstop.core.config import build_config
    from pitstop.core.corpus import sample_texts
    from pitstop.tiny import build_model_dir
    from pitstop.train.trainer import Trainer

    with tempfile.TemporaryDirectory(prefix="pitstop-bench-memflat-") as tmp:
        work = Path(tmp)
        model = build_model_dir(work / "model", layers=2, hidden=64, heads=2, vocab_size=512)
        data = work / "docs.jsonl"
        data.write_text(
            "".join(json.dumps({"text": t}) + "\n" for t in sample_texts(400)), encoding="utf-8"
        )
        cfg = build_config(
            cli_values={
                "model": str(model),
                "data": [str(data)],
                "output": str(work / "run"),
                "cache_dir": str(work / "cache"),
                "max_seq_len": 128,
                "tokens_per_step": 512,
                "max_steps": args.steps,
                "log_steps": 100,
                "report_to": "none",
            }
        )
        marks = sorted({args.at, args.steps // 2, args.steps})
        hooks = RssAt(set(marks))
        Trainer.from_config(cfg, hooks=hooks, save_final=False).fit()
    first = next(r for r in hooks.rows if r[0] == args.at)
    last = hooks.rows[-1]
    table = markdown_table(
        ["step", "resident (MiB)", "peak so far (MiB)"],
        [(s, f"{r:.1f}", f"{p:.1f}") for s, r, p in hooks.rows],
    )
    growth = last[2] / first[2] - 1
    verdict = "flat (within 5%)" if abs(growth) <= 0.05 else "GROWS (over 5%)"
    body = (
        f"{table}\n\nPeak at step {last[0]} against step {first[0]}: {growth:+.1%}, {verdict}.\n"
        "Model: Llama 2 layers, width 64, vocabulary 512; 512 tokens per step in rows of 128."
    )
    print(body)
    write_result("memory_flat", "Memory over a long run", body)


if __name__ == "__main__":
    main()
