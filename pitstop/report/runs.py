"""Reading a run directory (summary.json + metrics.jsonl) into typed records.

Both writers produce it: `pitstop train`, and a Hugging Face Trainer with
`pitstop.hf.PitstopCallback`. A run without summary.json (killed) is read from its
metrics.jsonl alone. The records and their validation are `pitstop.core.run_record`; the
contract, field by field, is docs/run-directory.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pitstop.core import run_record
from pitstop.core.errors import DataError
from pitstop.core.run_record import RunSummary, StepLine, read_steps, read_summary
from pitstop.measure.timeline import PHASES

__all__ = [
    "FINDINGS_MISSING",
    "FINDINGS_READ",
    "LoadedRun",
    "load_run",
    "read_steps",
    "summary_from_steps",
]

PHASE_ORDER = PHASES  # the trainer's phase names, in its order
FINDINGS_MISSING = "missing"
FINDINGS_READ = "read"


@dataclass
class LoadedRun:
    """A run directory as the report reads it: its summary, its step lines, the doctor's findings."""

    path: Path
    summary: RunSummary
    steps: list[StepLine] = field(default_factory=list)
    # findings.json as read (the JSON boundary): a findings.json of any writer or age only
    # annotates the report, which reads each key with a default, so it is not validated into
    # advise.finding.FindingRecord and stays a mapping.
    findings: list[dict[str, object]] = field(default_factory=list)
    # What findings.json said, so the report says what it saw: FINDINGS_MISSING (no file),
    # FINDINGS_READ (its list, which may be empty: the doctor found nothing to change), or
    # why the file could not be read.
    findings_state: str = FINDINGS_MISSING

    @property
    def name(self) -> str:
        return self.path.name or str(self.path)


def load_run(path: str | Path) -> LoadedRun:
    """Read a run directory; DataError when it is not one, or a file in it is damaged.

    A run without summary.json (killed, or still running) is read from its metrics.jsonl:
    the summary is rebuilt from the step lines and says so in its `status`.
    """
    p = Path(path)
    if not p.is_dir():
        raise DataError(f"{p} is not a directory; give the --output directory of `pitstop train`")
    steps = read_steps(p / run_record.METRICS)
    if (p / run_record.SUMMARY).is_file():
        summary = read_summary(p / run_record.SUMMARY)
    elif steps:
        summary = summary_from_steps(steps)
    else:
        raise DataError(
            f"{p} is not a pitstop run (no summary.json, and no metrics.jsonl with a step in it); "
            "give the --output directory of `pitstop train`, or the output_dir of a Hugging Face "
            "Trainer run with pitstop.hf.PitstopCallback"
        )
    findings, state = _findings(p / run_record.FINDINGS)
    return LoadedRun(p, summary, steps, findings, state)


def _findings(path: Path) -> tuple[list[dict[str, object]], str]:
    """The doctor's findings beside a run and what the file held (LoadedRun.findings_state).

    findings.json is the doctor's whole report with its list under "findings"
    (run_record.write_findings); a bare list is read too. A file that cannot be read only
    costs the report its findings table, and the report says why.
    """
    if not path.is_file():
        return [], FINDINGS_MISSING
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        return [], f"{path.name} could not be read ({type(e).__name__}: {e})"
    raw = data.get("findings") if isinstance(data, dict) else data
    if not isinstance(raw, list):
        return [], f'{path.name} holds no list of findings (under "findings")'
    records = [x for x in raw if isinstance(x, dict)]
    if raw and not records:
        return [], f"{path.name} holds {len(raw)} entries, none of them a finding"
    return records, FINDINGS_READ


def _last(steps: list[StepLine], key: str) -> float | None:
    for r in reversed(steps):
        v = r.number(key)
        if v is not None:
            return v
    return None


def summary_from_steps(steps: list[StepLine]) -> RunSummary:
    """A summary rebuilt from metrics.jsonl lines (a run without summary.json)."""
    phases: dict[str, float] = {}
    seconds = 0.0
    for r in steps:
        for k, v in r.phases.items():
            phases[k] = phases.get(k, 0.0) + v
        seconds += r.seconds or 0.0
    trained = _last(steps, "trained_tokens")  # cumulative in both writers
    if trained is None:
        per_step = [r.step_trained_tokens for r in steps if r.step_trained_tokens is not None]
        trained = float(sum(per_step)) or None
    last_step = _last(steps, "step")
    return RunSummary(
        status="incomplete: no summary.json (killed or still running); read from metrics.jsonl",
        optimizer_steps=int(last_step) if last_step is not None else len(steps),
        trained_tokens=trained,
        seen_tokens=_last(steps, "seen_tokens"),
        padded_tokens=_last(steps, "padded_tokens"),
        train_seconds=seconds or None,
        tokens_per_second=trained / seconds if trained and seconds else None,
        final_loss=_last(steps, "loss"),
        time_breakdown=phases,
        schema_version=0,
    )


def ordered_phases(names: set[str]) -> list[str]:
    known = [p for p in PHASE_ORDER if p in names]
    return known + sorted(names - set(known))


def series(run: LoadedRun, key: str) -> list[tuple[float, float]]:
    """(step, value) pairs of a numeric metric (a StepLine field or extra key) across the run."""
    pts = []
    for r in run.steps:
        v = r.number(key)
        if v is not None:
            pts.append((float(r.step), v))
    return pts


def tokens_per_second_series(run: LoadedRun) -> list[tuple[float, float]]:
    """Throughput per logged step: the line's own figure, else its tokens ÷ its time."""
    pts = series(run, "tokens_per_second")
    if pts:
        return pts
    out = []
    for r in run.steps:
        toks, secs = r.step_trained_tokens, r.seconds  # "trained_tokens" is cumulative
        if toks is not None and secs:
            out.append((float(r.step), float(toks) / secs))
    return out


def memory_series(run: LoadedRun) -> list[tuple[float, float]]:
    """Peak memory per step in bytes (a foreign writer's byte counts; GiB lines converted)."""
    for key in ("peak_memory_bytes", "memory_bytes", "memory_allocated_bytes", "rss_bytes"):
        pts = series(run, key)
        if pts:
            return pts
    return [(s, v * 2**30) for s, v in series(run, "peak_memory_gib")]


def breakdown(summary: RunSummary) -> dict[str, float]:
    """Seconds per phase (a "<phase>_s" key is read as "<phase>")."""
    return {k.removesuffix("_s"): float(v) for k, v in summary.time_breakdown.items()}


def flat_settings(summary: RunSummary) -> dict[str, Any]:
    """The settings of a run: its config, then each choice's value (choice.<name>)."""
    out: dict[str, Any] = dict(summary.config)
    for k, v in summary.choice_values().items():
        out[f"choice.{k}"] = v
    for k, v in (summary.requested or {}).items():  # PitstopCallback(requested=...)
        out[f"requested.{k}"] = v
    return out
