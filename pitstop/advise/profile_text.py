"""The text of a profile's report: phase breakdown, verdict and findings.

What `PitstopCallback` prints at the end of training and `pitstop profile -- CMD` prints
after the command: one function, without transformers, so the launcher of a profiled
command does not import a Trainer to print a table.
"""

from __future__ import annotations

from typing import Any

from pitstop.advise.doctor import DoctorReport
from pitstop.advise.finding import format_findings
from pitstop.measure.timeline import PHASES
from pitstop.measure.verdict import format_verdict, verdict

__all__ = ["EVENT_OF_PHASE", "format_profile"]

# The event counted with each phase that has one, and how the report names it.
EVENT_OF_PHASE = {
    "checkpoint": ("checkpoints", "saves"),
    "eval": ("evals", "evaluations"),
    "gc_collect": ("gc_collects", "gc.collect() calls"),
    "empty_cache": ("empty_cache_calls", "empty_cache() calls"),
}


def format_profile(profile: dict[str, Any] | None, report: DoctorReport | None) -> str:
    """The end-of-training report of `profile` (a profile.json), with `report`'s findings."""
    if profile is None:
        return "pitstop: no profile (training did not run a step)"
    p = profile
    total = sum(p["step_seconds"]) or 1.0
    lines = [
        f"pitstop profile: {p['steps']} steps after {p['warmup']} warm-up, "
        f"{total / max(p['steps'], 1):.4f} s/step, {p['tokens_per_second']:,.0f} tokens/s"
        + (f", MFU {100 * p['mfu']:.1f}%" if p.get("mfu") is not None else "")
        + (" (training time: evaluation left out)" if p["phases"].get("eval") else ""),
    ]
    lines += [f"  note: {n}" for n in p.get("notes") or [] if str(n).startswith("MFU not")]
    events = p.get("events") or {}
    extra = [k for k in p["phases"] if k not in PHASES]  # a producer's own phases
    for name in (*PHASES, *extra):
        sec = p["phases"].get(name, 0.0)
        line = f"  {name:<15}{sec:>10.4f} s  {100 * sec / total:5.1f}%"
        if name in EVENT_OF_PHASE and events.get(EVENT_OF_PHASE[name][0]):
            event, what = EVENT_OF_PHASE[name]
            line += f"  ({events[event]} {what})"
        lines.append(line)
    startup = p.get("worker_startup")
    if startup:
        lines.append(
            f"  worker start-up (inside data_wait): {startup['seconds']:.4f} s in "
            f"{startup['starts']} start(s); {startup['warmup_seconds']:.4f} s in "
            f"{startup['warmup_starts']} start(s) in the warm-up, left out above"
        )
    stop = p.get("worker_shutdown")
    if stop:
        lines.append(
            f"  worker shut-down at epoch ends (inside data_wait): {stop['seconds']:.4f} s "
            f"in {stop['stops']} stop(s)"
        )
    tf32 = (p.get("choices") or {}).get("tf32")
    if isinstance(tf32, dict):
        lines.append(f"  TF32: {tf32.get('value')} ({tf32.get('reason')})")
    lines.append(format_verdict(verdict(p)))
    if report is not None:
        lines += ["", format_findings(report["findings"])]
    return "\n".join(lines)
