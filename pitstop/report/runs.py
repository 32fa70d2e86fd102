"""Reading a run directory (summary.json + metrics.jsonl), tolerantly.

Both writers produce it: `pitstop train`, and a Hugging Face Trainer with
`pitstop.hf.PitstopCallback`. A run without summary.json (killed) is read from its
metrics.jsonl alone.

The contract (docs/run-directory.md): summary.json holds trained/seen/padded tokens,
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
    """Read a run directory; DataError when it is not one.

    A run without summary.json (killed, or still running) is read from its metrics.jsonl:
    the summary is rebuilt from the step lines and says so in its "status".
    """
    p = Path(path)
    if not p.is_dir():
        raise DataError(f"{p} is not a directory; give the --output directory of `pitstop train`")
    sp, mp = p / run_files.SUMMARY, p / run_files.METRICS
    steps = read_steps(mp) if mp.is_file() else []
    if sp.is_file():
        try:
            summary = json.loads(sp.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise DataError(f"{sp} is not valid JSON ({e})") from None
        if not isinstance(summary, dict):
            raise DataError(f"{sp} is not a JSON object")
    elif steps:
        summary = summary_from_steps(steps)
    else:
        raise DataError(
            f"{p} is not a pitstop run (no summary.json, and no metrics.jsonl with a step in it); "
            "give the --output directory of `pitstop train`, or the output_dir of a Hugging Face "
            "Trainer run with pitstop.hf.PitstopCallback"
        )
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


def read_steps(path: Path) -> list[dict[str, Any]]:
    """The step records of a metrics.jsonl.

    The last line may be cut short by a crash (the writer appends whole lines, so only
    the last one can be torn) and is skipped; any other line that is not a JSON object is
    a DataError naming the file and the line.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{path} is not UTF-8 text ({e}); it is not a pitstop metrics file"
        ) from None
    # The piece after the last newline is "" or a crash's half-written line: dropped.
    lines = text.split("\n")[:-1]
    steps = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise DataError(
                f"{path} line {i} is not valid JSON ({e}): {line[:80]!r}; remove or repair that "
                "line (each line is one optimizer step)"
            ) from None
        if not isinstance(rec, dict):
            raise DataError(f"{path} line {i} is not a JSON object; each line is one step's record")
        rec.setdefault("step", i)
        steps.append(rec)
    return steps


def _last_number(steps: list[dict[str, Any]], key: str) -> float | None:
    for r in reversed(steps):
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v:
            return float(v)
    return None


def summary_from_steps(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """A summary.json's figures rebuilt from metrics.jsonl lines (a run without one)."""
    phases: dict[str, float] = {}
    seconds = 0.0
    for r in steps:
        ph = step_phases(r)
        for k, v in ph.items():
            phases[k] = phases.get(k, 0.0) + v
        secs = r.get("step_seconds")
        seconds += float(secs) if isinstance(secs, (int, float)) else sum(ph.values())
    trained = _last_number(steps, "trained_tokens")  # cumulative in both writers
    if trained is None:
        per_step = [r.get("step_trained_tokens") for r in steps]
        trained = float(sum(t for t in per_step if isinstance(t, (int, float)))) or None
    last_step = _last_number(steps, "step")
    return {
        "status": "incomplete: no summary.json (killed or still running); read from metrics.jsonl",
        "optimizer_steps": int(last_step) if last_step is not None else len(steps),
        "trained_tokens": trained,
        "seen_tokens": _last_number(steps, "seen_tokens"),
        "padded_tokens": _last_number(steps, "padded_tokens"),
        "train_seconds": seconds or None,
        "tokens_per_second": trained / seconds if trained and seconds else None,
        "final_loss": _last_number(steps, "loss"),
        "time_breakdown": phases,
    }


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
    requested = summary.get("requested") or {}  # PitstopCallback(requested=...)
    if isinstance(requested, dict):
        for k, v in requested.items():
            out[f"requested.{k}"] = v
    return out
