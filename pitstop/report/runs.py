"""Reading a `pitstop train` run directory (summary.json + metrics.jsonl), tolerantly.

The contract (DESIGN.md): summary.json holds trained/seen/padded tokens,
optimizer_steps, train/wall seconds, tokens_per_second, mfu, peak_memory_bytes,
final_loss, time_breakdown (seconds per phase), device, choices (value + reason);
metrics.jsonl holds one JSON object per optimizer step. Step records are read
whatever their exact keys: phases may be a nested "phases" dict or flat
"<phase>_s" keys; the step number may be "step" or the line index.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pitstop import run_files
from pitstop.errors import DataError
from pitstop.measure.timeline import PHASES

PHASE_ORDER = PHASES  # the trainer's phase names, in its order
# Flat keys ending in _s that are not phases.
_NOT_PHASES = {"step", "elapsed", "time", "wall", "train", "step_time", "total", "eta"}


@dataclass
class Run:
    path: Path
    summary: dict[str, Any]
    steps: list[dict[str, Any]] = field(default_factory=list)
    findings: list[dict[str, Any]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.path.name or str(self.path)


def load_run(path: str | Path) -> Run:
    """Read a run directory; DataError when it is not one."""
    p = Path(path)
    if not p.is_dir():
        raise DataError(f"{p} is not a directory; give the --output directory of `pitstop train`")
    sp = p / run_files.SUMMARY
    if not sp.is_file():
        raise DataError(
            f"{p} is not a pitstop run (no summary.json); give the --output directory of a "
            "finished `pitstop train`"
        )
    try:
        summary = json.loads(sp.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{sp} is not valid JSON ({e})") from None
    if not isinstance(summary, dict):
        raise DataError(f"{sp} is not a JSON object")
    steps = []
    mp = p / run_files.METRICS
    if mp.is_file():
        with open(mp, encoding="utf-8") as f:
            for i, line in enumerate(f):
                line = line.strip()
                if not line:
                    continue
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a line cut short by a crash: the rest is still useful
                if isinstance(rec, dict):
                    rec.setdefault("step", i + 1)
                    steps.append(rec)
    findings: list[dict[str, Any]] = []
    fp = p / run_files.FINDINGS
    if fp.is_file():
        try:
            data = json.loads(fp.read_text(encoding="utf-8"))
            raw = data.get("findings", []) if isinstance(data, dict) else data
            findings = [x for x in raw if isinstance(x, dict)]
        except (ValueError, UnicodeDecodeError):
            findings = []
    return Run(p, summary, steps, findings)


def step_phases(rec: dict[str, Any]) -> dict[str, float]:
    """Seconds per phase of one metrics.jsonl record (nested "phases" or flat "<phase>_s")."""
    out: dict[str, float] = {}
    nested = rec.get("phases") or rec.get("time_breakdown")
    if isinstance(nested, dict):
        for k, v in nested.items():
            if isinstance(v, (int, float)):
                out[k.removesuffix("_s")] = float(v)
        return out
    for k, v in rec.items():
        if k.endswith("_s") and isinstance(v, (int, float)) and not isinstance(v, bool):
            name = k[:-2]
            if name not in _NOT_PHASES:
                out[name] = float(v)
    return out


def ordered_phases(names: set[str]) -> list[str]:
    known = [p for p in PHASE_ORDER if p in names]
    return known + sorted(names - set(known))


def series(run: Run, key: str) -> list[tuple[float, float]]:
    """(step, value) pairs of a numeric metric across the run's steps."""
    pts = []
    for r in run.steps:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v:  # not NaN
            pts.append((float(r["step"]), float(v)))
    return pts


def tokens_per_second_series(run: Run) -> list[tuple[float, float]]:
    """Throughput per logged step: the record's own figure, else tokens ÷ step time."""
    pts = series(run, "tokens_per_second")
    if pts:
        return pts
    out = []
    for r in run.steps:
        toks = r.get("step_trained_tokens")  # "trained_tokens" is cumulative in the trainer
        secs = r.get("step_seconds") or r.get("step_s") or sum(step_phases(r).values())
        if isinstance(toks, (int, float)) and secs:
            out.append((float(r["step"]), float(toks) / float(secs)))
    return out


def memory_series(run: Run) -> list[tuple[float, float]]:
    for key in ("peak_memory_bytes", "memory_bytes", "memory_allocated_bytes", "rss_bytes"):
        pts = series(run, key)
        if pts:
            return pts
    return []


def breakdown(summary: dict[str, Any]) -> dict[str, float]:
    tb = summary.get("time_breakdown") or {}
    return {
        k.removesuffix("_s"): float(v)
        for k, v in tb.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def flat_settings(summary: dict[str, Any]) -> dict[str, Any]:
    """The settings of a run: its config, then each choice's value (choice.<name>)."""
    out: dict[str, Any] = {}
    cfg = summary.get("config") or {}
    if isinstance(cfg, dict):
        for k, v in cfg.items():
            out[k] = v
    choices = summary.get("choices") or {}
    if isinstance(choices, dict):
        for k, v in choices.items():
            out[f"choice.{k}"] = v.get("value") if isinstance(v, dict) else v
    return out
