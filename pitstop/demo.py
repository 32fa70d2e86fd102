"""`pitstop demo`: the embedded default, end to end on whatever device exists.

1. builds a tiny Llama and a tokenizer trained on the bundled corpus (no download);
2. prepares the corpus into a token store and prints its length statistics;
3. trains for a fixed number of optimizer steps (about a minute on a 2-core CPU) with
   every choice made by measurement, and prints where the step time went;
4. prints the doctor's findings for that run and the outputs' paths.

Everything runs through the same library calls as the individual commands.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pitstop.core import run_record
from pitstop.core.config import build_config
from pitstop.core.corpus import sample_corpus_path
from pitstop.core.run_record import RunSummary
from pitstop.data.prepare import format_stats, prepare_data
from pitstop.report.estimate import format_estimate
from pitstop.report.html import write_report
from pitstop.report.planned import estimate_planned_run
from pitstop.tiny import build_model_dir
from pitstop.train import fit


def _say(msg: str) -> None:
    # On stdout with the results, so headings and tables stay in order when both are piped.
    sys.stderr.flush()
    print(f"\n[demo] {msg}", flush=True)


def format_breakdown(summary: RunSummary) -> str:
    """Seconds and share per phase of a run's summary, largest first."""
    phases = summary.time_breakdown
    total = sum(phases.values()) or 1.0
    lines = [f"where the {total:.1f} s of training went"]
    for name, sec in sorted(phases.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {name:<15} {sec:8.2f} s  {100 * sec / total:5.1f}%")
    tps = summary.tokens_per_second or 0.0
    mfu = summary.mfu
    mfu_s = f"{100 * mfu:.1f}%" if mfu is not None else "n/a"
    lines.append(
        f"  trained tokens/s {tps:,.0f}   MFU {mfu_s}   peak memory "
        f"{(summary.peak_memory_bytes or 0) / 2**20:,.0f} MiB   "
        f"padding waste {100 * (summary.padding_waste or 0):.1f}%"
    )
    return "\n".join(lines)


def run_demo(output: str = "demo-out", max_steps: int = 80) -> int:
    out = Path(output).resolve()
    out.mkdir(parents=True, exist_ok=True)
    _say(f"building a tiny Llama and its tokenizer in {out / 'model'}")
    model_dir = build_model_dir(out / "model", layers=4, hidden=128, heads=4)

    base = {
        "data": [str(sample_corpus_path())],
        "model": str(model_dir),
        "max_seq_len": 512,
        "cache_dir": str(out / "cache"),
    }
    _say(f"preparing the bundled corpus ({sample_corpus_path().name})")
    prepared = prepare_data(build_config(base, command="prepare"))
    print(format_stats(prepared.stats))
    print(f"\ntoken store: {prepared.store_path}")

    run_dir = out / "run"
    cfg = build_config(
        {
            **base,
            "data": [str(prepared.store_path)],
            "output": str(run_dir),
            "max_steps": max_steps,
            "log_steps": 5,
            "overwrite": (run_dir / run_record.SUMMARY).exists(),
        },
        command="train",
    )
    _say(f"training {max_steps} optimizer steps into {run_dir}")
    summary = fit(cfg)
    print()
    print(format_breakdown(summary))

    _say("the doctor's findings for this run")
    # Deferred: pitstop.advise imports torch, which `pitstop --help` (that lists the demo)
    # must not load.
    from pitstop.advise.doctor import doctor
    from pitstop.advise.finding import format_findings

    report = doctor(
        config=cfg,
        data=prepared.store_path,
        cache_dir=out / "cache",
        compile_check=False,
        disk_check=False,
    )
    print(format_findings(report["findings"]))
    # The HTML report shows the findings next to the curves.
    run_record.write_findings(run_dir, report)

    _say("a full epoch of this corpus, estimated from this run's measured throughput")
    est = estimate_planned_run(
        model=str(model_dir),
        data=str(prepared.store_path),
        from_profile=str(run_dir),
        cache_dir=str(out / "cache"),
    )
    print(format_estimate(est))
    report_path = write_report(run_dir, run_dir / "report.html")

    print(f"\noutputs: {run_dir}")
    print(
        f"  report           {report_path}  (self-contained HTML: curves, step-time breakdown, findings)"
    )
    print(
        f"  final model      {run_dir / 'final'}  (AutoModelForCausalLM.from_pretrained loads it)"
    )
    print(f"  summary          {run_dir / run_record.SUMMARY}")
    print(f"  per-step metrics {run_dir / run_record.METRICS}")
    return 0
