"""`pitstop compare`: a before/after table of two runs, and the settings that differ.

Every figure comes from the runs' summary.json (the `pitstop train` contract):
tokens/s = trained_tokens / train_seconds; it/s = optimizer_steps / train_seconds;
cost = wall_seconds × GPUs × price per GPU-hour (you pay for the whole process);
data-wait share = time_breakdown.data_wait / sum(time_breakdown);
padding waste = 1 − seen_tokens / padded_tokens; trained tokens per step =
trained_tokens / optimizer_steps. Ratios are B / A. Steps/s and tokens/s stand side by
side: when the two runs' steps hold different numbers of trained tokens, a faster
step is not a speed-up, and the comparison says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pitstop.report.runs import LoadedRun, breakdown, flat_settings, load_run
from pitstop.run_record import RunSummary


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    unit: str
    higher_is_better: bool | None  # None: neither (e.g. loss at different settings)


METRICS = [
    Metric("tokens_per_second", "tokens/s", "tok/s", True),
    Metric("iterations_per_second", "optimizer steps/s", "it/s", True),
    Metric("trained_tokens_per_step", "trained tokens/step", "tok", None),
    Metric("train_seconds", "train time", "s", False),
    Metric("wall_seconds", "wall time", "s", False),
    Metric("cost", "cost", "USD", False),
    Metric("mfu", "MFU", "", True),
    Metric("peak_memory_bytes", "peak memory", "bytes", False),
    Metric("data_wait_share", "data-wait share", "", False),
    Metric("padding_waste", "padding waste", "", False),
    Metric("final_loss", "final loss", "", None),
]


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def gpu_count(summary: RunSummary) -> int:
    """GPUs the run paid for: its world size, else the config's process count, else 1."""
    if summary.world_size:
        return summary.world_size
    nproc = _num(summary.config.get("nproc"))  # a RunConfig field, not a summary one
    return int(nproc) if nproc and nproc >= 1 else 1


def run_metrics(run: LoadedRun, price: float | None = None) -> dict[str, float | None]:
    """The compared figures of one run (None where the run did not record what is needed)."""
    s = run.summary
    train, wall = _num(s.train_seconds), _num(s.wall_seconds)
    trained = _num(s.trained_tokens)
    tps = _num(s.tokens_per_second)
    if tps is None and train and trained:
        tps = trained / train
    steps = _num(s.optimizer_steps)
    tb = breakdown(s)
    total = sum(tb.values())
    seen, padded = _num(s.seen_tokens), _num(s.padded_tokens)
    secs_paid = wall or train
    return {
        "tokens_per_second": tps,
        "iterations_per_second": steps / train if steps and train else None,
        "trained_tokens_per_step": trained / steps if steps and trained else None,
        "train_seconds": train,
        "wall_seconds": wall,
        "cost": secs_paid / 3600 * gpu_count(s) * price
        if (price is not None and secs_paid)
        else None,
        "mfu": _num(s.mfu),
        "peak_memory_bytes": _num(s.peak_memory_bytes),
        "data_wait_share": tb.get("data_wait", 0.0) / total if total else None,
        "padding_waste": 1 - seen / padded if (seen is not None and padded) else None,
        "final_loss": _num(s.final_loss),
    }


def setting_differences(a: LoadedRun, b: LoadedRun) -> list[tuple[str, Any, Any]]:
    sa, sb = flat_settings(a.summary), flat_settings(b.summary)
    # Where files went is not a setting (pitstop's names, then TrainingArguments').
    skip = {"output", "cache_dir", "overwrite", "resume", "output_dir", "logging_dir", "run_name"}
    out = []
    for k in sorted(set(sa) | set(sb)):
        if k in skip:
            continue
        if sa.get(k) != sb.get(k):
            out.append((k, sa.get(k, "-"), sb.get(k, "-")))
    return out


def compare(
    a: str | Path | LoadedRun, b: str | Path | LoadedRun, price: float | None = None
) -> dict[str, Any]:
    """The comparison as data: per metric A, B and B/A; the settings that differ."""
    ra = a if isinstance(a, LoadedRun) else load_run(a)
    rb = b if isinstance(b, LoadedRun) else load_run(b)
    ma, mb = run_metrics(ra, price), run_metrics(rb, price)
    rows = []
    for m in METRICS:
        va, vb = ma[m.key], mb[m.key]
        ratio = vb / va if (va is not None and vb is not None and va != 0) else None
        better = None
        if ratio is not None and m.higher_is_better is not None and abs(ratio - 1) > 0.005:
            better = (ratio > 1) == m.higher_is_better
        row = {"metric": m.key, "label": m.label, "unit": m.unit}
        rows.append({**row, "a": va, "b": vb, "ratio": ratio, "b_better": better})
    return {
        "a": str(ra.path),
        "b": str(rb.path),
        "price_per_gpu_hour": price,
        "metrics": rows,
        "notes": _notes(ma, mb, ra, rb),
        "settings_differ": [
            {"setting": k, "a": x, "b": y} for k, x, y in setting_differences(ra, rb)
        ],
    }


# Trained tokens per step that differ by more than this are a different training step.
TOKENS_PER_STEP_TOLERANCE = 0.02


def _notes(
    ma: dict[str, float | None], mb: dict[str, float | None], ra: LoadedRun, rb: LoadedRun
) -> list[str]:
    """What a reader must know before taking a ratio as a speed-up."""
    out = []
    ta, tb = ma["trained_tokens_per_step"], mb["trained_tokens_per_step"]
    if ta and tb and abs(tb / ta - 1) > TOKENS_PER_STEP_TOLERANCE:
        fewer = "fewer" if tb < ta else "more"
        out.append(
            f"B's optimizer step holds {fewer} trained tokens than A's ({tb:,.0f} vs {ta:,.0f}, "
            f"{tb / ta:.2f}x): a faster step is not a speed-up when the step holds fewer tokens. "
            "Compare trained tokens/s; the runs also learn differently (another effective "
            "batch: retune the learning rate, or keep tokens per step equal)"
        )
    for r in (ra, rb):
        status = r.summary.status or ""
        if status.startswith("incomplete"):
            out.append(f"{r.path}: {status}")
    return out


def fmt_value(key: str, v: float | None) -> str:
    if v is None:
        return "-"
    if key == "peak_memory_bytes":
        return f"{v / 1024**3:.2f} GiB"
    if key in ("mfu", "data_wait_share", "padding_waste"):
        return f"{v:.1%}"
    if key in ("train_seconds", "wall_seconds"):
        return f"{v:,.1f} s"
    if key == "cost":
        return f"{v:,.2f} USD"
    if key == "final_loss":
        return f"{v:.4f}"
    if key == "iterations_per_second":
        return f"{v:.3f}"
    if key == "trained_tokens_per_step":
        return f"{v:,.1f}"
    return f"{v:,.0f}"


def _ratio(r: dict[str, Any]) -> str:
    if r["ratio"] is None:
        return "-"
    mark = {True: " (better)", False: " (worse)", None: ""}[r["b_better"]]
    return f"{r['ratio']:.2f}x{mark}"


def format_compare(result: dict[str, Any], markdown: bool = False) -> str:
    """A plain-text (or Markdown) table of `compare`'s result."""
    head = ["metric", "A", "B", "B/A"]
    body = [
        [r["label"], fmt_value(r["metric"], r["a"]), fmt_value(r["metric"], r["b"]), _ratio(r)]
        for r in result["metrics"]
    ]
    diffs = [
        [d["setting"], json.dumps(d["a"]), json.dumps(d["b"])] for d in result["settings_differ"]
    ]
    out = [f"A: {result['a']}", f"B: {result['b']}"]
    if result["price_per_gpu_hour"] is None:
        out.append("(cost: give --price-per-gpu-hour)")
    out.append("")
    out += _table(head, body, markdown)
    out.append("")
    for note in result.get("notes") or []:
        out += ["Note: " + note, ""]
    if diffs:
        out.append("Settings that differ:")
        out += _table(["setting", "A", "B"], diffs, markdown)
    else:
        out.append("No recorded setting differs.")
    return "\n".join(out)


def _table(head: list[str], rows: list[list[str]], markdown: bool) -> list[str]:
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        return lines + ["| " + " | ".join(r) + " |" for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [
        fmt.format(*r) for r in rows
    ]
