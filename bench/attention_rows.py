"""`sdpa_docs` on a CPU: a call per document against each row as matrix products, and what
`pitstop train` picks (train/attention_rows.py).

    .venv/bin/python -m bench.attention_rows [--lengths 128,256,512] [--precisions bf16,fp32]
                                             [--steps 24] [--repeats 2] [--long-lengths 1024]
                                             [--out FILE]

For each row length and precision it trains `bench.tune`'s tiny Llama (4 layers, width 256,
4 heads of 64, vocab 4096; `pitstop train` defaults, packed rows, the CPU's default
micro-batch of ~2,048 positions) twice in turn, `--repeats` times: once with every row as
matrix products, once with a call per document (the choice forced either way; nothing
else differs), and reports the median per-step trained tokens/s of each (the first 2 steps
left out). Beside it: the timing `pitstop train` decides with (forward and backward of the
attention alone at the run's micro-batch, rows packed with documents of the data's median
length) and what it picked, timed afresh (no cache), and whether the pick was the faster
run. Then the attention alone at `--long-lengths`, rows too long for `pitstop train` to
time. bf16 rows are left out on a CPU without native bf16.

Writes bench/results/attention_rows.md with the machine it ran on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PITSTOP_PROGRESS", "0")

from bench.common import command_line, corpus_store, machine, markdown_table, write_result

WARMUP_STEPS = 2
EVEN = 0.03  # runs this close are even: the same settings run twice differ as much here


def _train(
    base: dict[str, Any], out: Path, force: bool | None
) -> tuple[float | None, dict[str, Any]]:
    """(median per-step trained tok/s, None for a run of warm-up steps only; the
    attention_rows choice) of one run; `force` sets the choice (None: pitstop's own, timed)."""
    from pitstop.core.config import build_config
    from pitstop.train import attention_rows, run

    saved = attention_rows.ROWS_MIN_GAIN, attention_rows.TIMING_COST_S
    if force is not None:
        attention_rows.ROWS_MIN_GAIN = 0.0 if force else float("inf")
    attention_rows.TIMING_COST_S = 0.0  # always timed: the bench run is short
    try:
        summary = run(build_config({**base, "output": str(out)}, None, command="train"))
    finally:
        attention_rows.ROWS_MIN_GAIN, attention_rows.TIMING_COST_S = saved
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_second"] for r in lines if r["step"] > WARMUP_STEPS]
    rate = statistics.median(rates) if rates else None
    return rate, summary["choices"]["attention_rows"]


def bench_length(
    work: Path, model_dir: Path, length: int, precision: str, steps: int, repeats: int
) -> list[str]:
    store = corpus_store(work / f"store-{length}", model_dir, 300, length)
    base = {
        "model": str(model_dir),
        "data": [str(store)],
        "max_seq_len": length,
        "precision": precision,
        "max_steps": steps,
        "log_steps": 1,
        "report_to": ["none"],
    }
    rates: dict[bool, list[float]] = {True: [], False: []}
    for r in range(repeats):
        for rows in (True, False):
            cache = work / f"cache-{length}-{precision}-{rows}-{r}"
            out = work / f"o{length}{precision}{rows}{r}"
            rate, _ = _train({**base, "cache_dir": str(cache)}, out, rows)
            assert rate is not None, f"{steps} steps: none after the warm-up"
            rates[rows].append(rate)
            print(f"  rows of {length}, {precision}, rows={rows}: {rate:,.0f} tok/s", flush=True)
    cache = work / f"cache-{length}-{precision}-auto"
    auto = work / f"auto-{length}-{precision}"
    _, choice = _train({**base, "cache_dir": str(cache), "max_steps": 1}, auto, None)
    m = choice.get("measured") or {}
    rows_rate, docs_rate = statistics.median(rates[True]), statistics.median(rates[False])
    picked = bool(choice["value"])
    ratio = rows_rate / docs_rate
    if abs(ratio - 1) < EVEN:
        faster = f"even (within {EVEN:.0%})"
    else:
        faster = "yes" if (ratio > 1) == picked else "NO"
    return [
        str(length),
        precision,
        f"{m.get('documents_seconds', 0) * 1e3:.2f} / {m.get('rows_seconds', 0) * 1e3:.2f}",
        f"{m.get('rows_speedup', 0):.2f}x",
        "rows" if picked else "per document",
        f"{docs_rate:,.0f}",
        f"{rows_rate:,.0f}",
        f"{ratio:.2f}x",
        faster,
    ]


def bench_long(length: int, precisions: list[str]) -> list[list[str]]:
    """The attention alone at a row length `pitstop train` never times for rows."""
    import torch

    from pitstop.train.attention_rows import measure_rows_speed

    out = []
    for precision in precisions:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        for doc_len in (length, length // 2):
            shape = (max(1, 2048 // length), 4, 4, length, 64)
            docs_s, rows_s = measure_rows_speed(shape, dtype, doc_len)
            docs = "one a row" if doc_len == length else f"{doc_len} positions"
            out.append([
                str(length), precision, docs, f"{docs_s * 1e3:.2f} / {rows_s * 1e3:.2f}",
                f"{docs_s / rows_s:.2f}x",
            ])  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.attention_rows", description=__doc__)
    ap.add_argument("--lengths", default="128,256,512", help="row lengths, comma-separated")
    ap.add_argument("--precisions", default="bf16,fp32", help="bf16 and/or fp32")
    ap.add_argument(
        "--long-lengths", default="1024", help="longer rows to time the attention alone at"
    )
    ap.add_argument("--steps", type=int, default=24, help="steps a run (default 24)")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each path (default 2)")
    ap.add_argument("--out", help="the results file (default bench/results/attention_rows.md)")
    args = ap.parse_args(argv)

    from pitstop.probe import cpu_has_bf16
    from pitstop.tiny import build_model_dir
    from pitstop.train.attention_rows import ROWS_MAX_LEN

    precisions = [p for p in args.precisions.split(",") if p == "fp32" or cpu_has_bf16()]
    work = Path(tempfile.mkdtemp(prefix="pitstop-bench-rows-"))
    model_dir = build_model_dir(work / "model", layers=4, hidden=256, heads=4, vocab_size=4096)
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        for precision in precisions:
            rows.append(bench_length(work, model_dir, length, precision, args.steps, args.repeats))
    headers = [
        "row length",
        "precision",
        "attention ms: per document / rows (timed)",
        "timed speedup",
        "pitstop picked",
        "trained tok/s, per document",
        "trained tok/s, rows",
        "rows / per document",
        "picked the faster",
    ]
    table = markdown_table(headers, rows)
    print(table)
    long_table = markdown_table(
        ["row length", "precision", "documents", "attention ms: per document / rows", "speedup"],
        [row for n in args.long_lengths.split(",") if n for row in bench_long(int(n), precisions)],
    )
    print(long_table)
    notes = (
        f"- Model: tiny Llama, 4 layers, width 256, 4 heads of 64, vocab 4096; 300 chapters of "
        f"the bundled corpus. Each run: `pitstop train` defaults, {args.steps} steps; the "
        f"median per-step trained tokens/s, steps 1-{WARMUP_STEPS} left out; the median of "
        f"{args.repeats} run(s) each, the two paths in turn.\n"
        "- The timing is `pitstop train`'s own (train/attention_rows.py), taken afresh in a "
        "separate 1-step run: attention forward+backward at the run's micro-batch. Rows are "
        "picked at 1.10x or more."
    )
    body = "\n".join([
        table, "",
        f"Longer rows, which `pitstop train` does not time (over {ROWS_MAX_LEN} positions): the "
        "attention alone, forward and backward, at micro-batches of 2,048 positions, 4 heads "
        "of 64, best of 5 (`attention_rows.measure_rows_speed`):", "",
        long_table, "", "Notes:", "", notes,
    ])  # fmt: skip
    title = "sdpa_docs on a CPU: a call per document against each row as matrix products"
    path = write_result(
        "attention_rows",
        title,
        body,
        command=command_line(),
        machine_info=machine(),
        path=Path(args.out) if args.out else None,
    )
    print(f"\n[attention_rows] wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
