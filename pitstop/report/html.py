"""`pitstop report`: one self-contained HTML file with inline SVG charts.

No script, no fonts, no CDN: every chart is SVG written here, so the file opens
offline and can be mailed or attached to a ticket. Sections: summary and cost,
loss curve, tokens/s over steps, stacked step-time breakdown (phases per step
from metrics.jsonl), memory, the doctor's findings (RUN_DIR/findings.json), and,
for several runs, the comparison table with overlaid curves.
"""

from __future__ import annotations

import html
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pitstop.core.run_record import RunSummary
from pitstop.report.compare import (
    METRICS,
    basis_line,
    compare,
    fmt_value,
    noise_cells,
    run_metrics,
    verdict_text,
)
from pitstop.report.runs import (
    FINDINGS_MISSING,
    FINDINGS_READ,
    LoadedRun,
    breakdown,
    load_run,
    memory_series,
    ordered_phases,
    series,
    tokens_per_second_series,
)

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
PHASE_COLORS = {
    "data_wait": "#d62728",
    "host_to_device": "#ff7f0e",
    "forward": "#1f77b4",
    "backward": "#2ca02c",
    "optimizer": "#9467bd",
    "checkpoint": "#8c564b",
    "eval": "#e377c2",
    "logging": "#bcbd22",
    "other": "#7f7f7f",
}
MAX_BARS = 120  # more steps than this are averaged into buckets so bars stay visible

CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#222;background:#fff;max-width:1150px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
table{border-collapse:collapse;margin:6px 0}td,th{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f4f6f8}td.num{text-align:right;font-variant-numeric:tabular-nums}
.better{color:#17803d}.worse{color:#b42318}.muted{color:#666}.charts{display:flex;flex-wrap:wrap;gap:16px}
svg.chart{background:#fafbfc;border:1px solid #e3e6ea}
.sev-high,.sev-critical{color:#b42318;font-weight:600}.sev-medium{color:#b54708}.sev-low,.sev-info{color:#475467}
"""


def text(x: Any) -> str:
    """`x` as HTML (or SVG) text content: every value a report shows goes through here.

    LoadedRun names, phase keys, settings and findings come from files anyone can craft;
    escaping `&`, `<` and `>` keeps them from opening an element.
    """
    return html.escape(str(x), quote=False)


def attr(x: Any) -> str:
    """`x` as the value of a double-quoted attribute: quotes escaped too, so it cannot end it."""
    return html.escape(str(x), quote=True)


def _nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.ceil(lo / step) * step
    ticks = []
    t = start
    while t <= hi + 1e-9 * step:
        ticks.append(round(t, 10))
        t += step
    return ticks


def _fmt_tick(v: float) -> str:
    a = abs(v)
    if a >= 1e9:
        return f"{v / 1e9:g}G"
    if a >= 1e6:
        return f"{v / 1e6:g}M"
    if a >= 1e4:
        return f"{v / 1e3:g}k"
    return f"{v:g}"


class _Frame:
    """Plot-area geometry and value→pixel mapping shared by the chart functions."""

    def __init__(self, xs: list[float], ys: list[float], w: int, h: int, y0: bool) -> None:
        self.w, self.h = w, h
        self.left, self.right, self.top, self.bottom = 58, 12, 30, 40
        self.x0, self.x1 = (min(xs), max(xs)) if xs else (0.0, 1.0)
        if self.x1 == self.x0:
            self.x1 = self.x0 + 1
        lo, hi = (min(ys), max(ys)) if ys else (0.0, 1.0)
        if y0:
            lo = min(0.0, lo)
        pad = (hi - lo) * 0.05 or abs(hi) * 0.05 or 1.0
        self.y0, self.y1 = (lo if y0 else lo - pad), hi + pad

    def px(self, x: float) -> float:
        return self.left + (x - self.x0) / (self.x1 - self.x0) * (self.w - self.left - self.right)

    def py(self, y: float) -> float:
        return (
            self.h
            - self.bottom
            - (y - self.y0) / (self.y1 - self.y0) * (self.h - self.top - self.bottom)
        )

    def axes(self, title: str, xlabel: str, ylabel: str) -> list[str]:
        out = [
            f'<text x="{self.w / 2}" y="18" text-anchor="middle" font-size="13" font-weight="600">{text(title)}</text>'
        ]
        for t in _nice_ticks(self.y0, self.y1):
            y = self.py(t)
            out.append(
                f'<line x1="{self.left}" x2="{self.w - self.right}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e5e7eb"/>'
                f'<text x="{self.left - 4}" y="{y + 4:.1f}" text-anchor="end" font-size="10">{_fmt_tick(t)}</text>'
            )
        for t in _nice_ticks(self.x0, self.x1, 6):
            x = self.px(t)
            out.append(
                f'<text x="{x:.1f}" y="{self.h - self.bottom + 14}" text-anchor="middle" font-size="10">{_fmt_tick(t)}</text>'
            )
        out.append(
            f'<line x1="{self.left}" x2="{self.w - self.right}" y1="{self.h - self.bottom}" '
            f'y2="{self.h - self.bottom}" stroke="#333"/>'
            f'<line x1="{self.left}" x2="{self.left}" y1="{self.top}" y2="{self.h - self.bottom}" stroke="#333"/>'
            f'<text x="{self.w / 2}" y="{self.h - 6}" text-anchor="middle" font-size="11">{text(xlabel)}</text>'
            f'<text x="12" y="{self.h / 2}" text-anchor="middle" font-size="11" '
            f'transform="rotate(-90 12 {self.h / 2})">{text(ylabel)}</text>'
        )
        return out


def line_chart(
    name: str,
    title: str,
    lines: list[tuple[str, list[tuple[float, float]]]],
    xlabel: str,
    ylabel: str,
    w: int = 540,
    h: int = 280,
    y0: bool = False,
) -> str:
    """An SVG line chart; one polyline (with its points counted in data-points) per series."""
    xs = [x for _, pts in lines for x, _ in pts]
    ys = [y for _, pts in lines for _, y in pts]
    if not xs:
        return _empty(name, title, w, h)
    f = _Frame(xs, ys, w, h, y0)
    out = [
        f'<svg class="chart" data-chart="{attr(name)}" width="{w}" height="{h}" viewBox="0 0 {w} {h}" xmlns="http://www.w3.org/2000/svg">'
    ]
    out += f.axes(title, xlabel, ylabel)
    for i, (label, pts) in enumerate(lines):
        color = COLORS[i % len(COLORS)]
        coords = " ".join(f"{f.px(x):.1f},{f.py(y):.1f}" for x, y in pts)
        out.append(
            f'<polyline class="series" data-series="{attr(label)}" data-points="{len(pts)}" '
            f'fill="none" stroke="{color}" stroke-width="2" points="{coords}"/>'
        )
        if len(pts) == 1:
            x, y = pts[0]
            out.append(f'<circle cx="{f.px(x):.1f}" cy="{f.py(y):.1f}" r="3" fill="{color}"/>')
        if len(lines) > 1:
            ly = f.top + 4 + 14 * i
            out.append(
                f'<rect x="{w - f.right - 150}" y="{ly}" width="10" height="10" fill="{color}"/>'
                f'<text x="{w - f.right - 136}" y="{ly + 9}" font-size="10">{text(label[:24])}</text>'
            )
    out.append("</svg>")
    return "".join(out)


def stacked_bars(
    name: str, title: str, steps: list[tuple[float, dict[str, float]]], w: int = 1100, h: int = 300
) -> str:
    """Seconds per phase for each step (averaged into at most MAX_BARS buckets), stacked."""
    if not steps:
        return _empty(name, title, w, h)
    phases = ordered_phases({k for _, ph in steps for k in ph})
    size = max(1, math.ceil(len(steps) / MAX_BARS))
    buckets = []
    for i in range(0, len(steps), size):
        chunk = steps[i : i + size]
        avg = {p: sum(ph.get(p, 0.0) for _, ph in chunk) / len(chunk) for p in phases}
        buckets.append((chunk[0][0], chunk[-1][0], avg))
    tops = [sum(b[2].values()) for b in buckets]
    first, last = steps[0][0], steps[-1][0]
    # x in step units: bar j spans [its first step, its first step + size)
    f = _Frame([first, last + size], [0, max(tops) or 1.0], w - 150, h, True)
    f.x0, f.x1 = first, last + size
    out = [
        f'<svg class="chart" data-chart="{attr(name)}" width="{w}" height="{h}" viewBox="0 0 {w} {h}" xmlns="http://www.w3.org/2000/svg">'
    ]
    out += f.axes(
        title, "optimizer step" + (f" (mean of {size} per bar)" if size > 1 else ""), "seconds"
    )
    for s0, s1, avg in buckets:
        base = 0.0
        span = f.px(s0 + size) - f.px(s0)
        x, bw = f.px(s0) + 0.075 * span, max(1.0, 0.85 * span)
        for p in phases:
            v = avg[p]
            if v <= 0:
                continue
            y_top, y_bot = f.py(base + v), f.py(base)
            label = f"step {s0:g}" + (f"-{s1:g}" if s1 != s0 else "") + f": {p} {v * 1000:.1f} ms"
            out.append(
                f'<rect class="bar" data-phase="{attr(p)}" x="{x:.1f}" y="{y_top:.1f}" width="{bw:.1f}" '
                f'height="{max(0.5, y_bot - y_top):.1f}" fill="{attr(PHASE_COLORS.get(p, "#999"))}"><title>{text(label)}</title></rect>'
            )
            base += v
    for i, p in enumerate(phases):  # legend right of the plot
        ly = f.top + 16 * i
        out.append(
            f'<rect x="{w - 140}" y="{ly}" width="11" height="11" fill="{attr(PHASE_COLORS.get(p, "#999"))}"/>'
            f'<text x="{w - 124}" y="{ly + 10}" font-size="11">{text(p)}</text>'
        )
    out.append("</svg>")
    return "".join(out)


def hbars(name: str, title: str, items: list[tuple[str, float]], unit: str, w: int = 540) -> str:
    """Horizontal bars (one per item), e.g. peak memory per run."""
    h = 50 + 26 * max(1, len(items))
    if not items:
        return _empty(name, title, w, h)
    top = max(v for _, v in items) or 1.0
    out = [
        f'<svg class="chart" data-chart="{attr(name)}" width="{w}" height="{h}" viewBox="0 0 {w} {h}" xmlns="http://www.w3.org/2000/svg">',
        f'<text x="{w / 2}" y="18" text-anchor="middle" font-size="13" font-weight="600">{text(title)}</text>',
    ]
    for i, (label, v) in enumerate(items):
        y = 34 + 26 * i
        bw = (w - 260) * v / top
        out.append(
            f'<text x="150" y="{y + 14}" text-anchor="end" font-size="11">{text(label[:26])}</text>'
            f'<rect class="bar" x="156" y="{y}" width="{bw:.1f}" height="18" fill="{COLORS[i % len(COLORS)]}"/>'
            f'<text x="{160 + bw:.1f}" y="{y + 14}" font-size="11">{text(_human(v, unit))}</text>'
        )
    out.append("</svg>")
    return "".join(out)


def _human(v: float, unit: str) -> str:
    if unit == "bytes":
        return f"{v / 1024**3:.2f} GiB" if v >= 1024**3 else f"{v / 1024**2:.1f} MiB"
    return f"{v:,.1f} {unit}"


def _empty(name: str, title: str, w: int, h: int) -> str:
    return (
        f'<svg class="chart empty" data-chart="{attr(name)}" width="{w}" height="{h}" xmlns="http://www.w3.org/2000/svg">'
        f'<text x="{w / 2}" y="18" text-anchor="middle" font-size="13" font-weight="600">{text(title)}</text>'
        f'<text x="{w / 2}" y="{h / 2}" text-anchor="middle" fill="#888">no data recorded</text></svg>'
    )


def _summary_table(runs: list[LoadedRun], price: float | None) -> str:
    head = "".join(f"<th>{text(r.name)}</th>" for r in runs)
    rows = []
    metrics = [run_metrics(r, price) for r in runs]
    for m in METRICS:
        if m.key == "cost" and price is None:
            continue
        cells = "".join(
            f'<td class="num">{text(fmt_value(m.key, mm[m.key]))}</td>' for mm in metrics
        )
        rows.append(f"<tr><th>{text(m.label)}</th>{cells}</tr>")
    extra: list[tuple[str, Callable[[RunSummary], Any]]] = [
        ("trained tokens", lambda s: s.trained_tokens),
        ("optimizer steps", lambda s: s.optimizer_steps),
        ("device", lambda s: s.device_name if s.device else None),
    ]
    for label, value in extra:
        cells = "".join(f'<td class="num">{text(_show(value(r.summary)))}</td>' for r in runs)
        rows.append(f"<tr><th>{text(label)}</th>{cells}</tr>")
    return f"<table><tr><th></th>{head}</tr>{''.join(rows)}</table>"


def _show(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.4g}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _cost_section(runs: list[LoadedRun], price: float | None) -> str:
    if price is None:
        return (
            '<p class="muted">No price given: pass <code>--price-per-gpu-hour</code> to '
            "<code>pitstop report</code> (or <code>price=</code> to <code>write_report</code>) "
            "for the cost of each run.</p>"
        )
    items = []
    for r in runs:
        m = run_metrics(r, price)
        if m["cost"] is not None:
            tps = m["tokens_per_second"]
            per_m = price / 3600 / tps * 1e6 if tps else None
            items.append(
                f"<li><b>{text(r.name)}</b>: {m['cost']:.2f} USD for {fmt_value('wall_seconds', m['wall_seconds'])}"
                + (f"; {per_m:.4f} USD per million trained tokens" if per_m else "")
                + "</li>"
            )
    return f"<p>At {text(price)} USD per GPU-hour (wall time × GPUs × price):</p><ul>{''.join(items)}</ul>"


def _findings(run: LoadedRun) -> str:
    if not run.findings:
        # Say what findings.json held: an empty list is the doctor's answer, not a missing file.
        if run.findings_state == FINDINGS_READ:
            said = "the doctor found nothing to change (findings.json lists no findings)"
        elif run.findings_state == FINDINGS_MISSING:
            said = "no findings.json (run <code>pitstop doctor</code>)"
        else:
            said = f"{text(run.findings_state)}; run <code>pitstop doctor</code> again"
        return f'<p class="muted">{text(run.name)}: {said}.</p>'
    rows = []
    for f in run.findings:
        sev = str(f.get("severity", ""))
        rows.append(
            f'<tr><td class="sev-{attr(sev.lower())}">{text(sev)}</td><td><b>{text(f.get("title", ""))}</b>'
            f'<br><span class="muted">{text(f.get("id", ""))}</span></td><td>{text(f.get("evidence", ""))}</td>'
            f'<td>{text(f.get("effect", ""))}<br><span class="muted">{text(f.get("basis", ""))}</span></td>'
            f"<td>{text(f.get('fix', ''))}</td></tr>"
        )
    return (
        f"<h3>{text(run.name)}</h3><table><tr><th>severity</th><th>finding</th><th>evidence</th>"
        f"<th>effect (basis)</th><th>fix</th></tr>{''.join(rows)}</table>"
    )


def _comparison(runs: list[LoadedRun], price: float | None) -> str:
    base = runs[0]
    parts = []
    for other in runs[1:]:
        res = compare(base, other, price)
        rows = []
        for r in res["metrics"]:
            if r["a"] is None and r["b"] is None:
                continue
            cls = {True: "better", False: "worse", None: ""}[r["b_better"]]
            ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else "-"
            rows.append(
                f'<tr><th>{text(r["label"])}</th><td class="num">{text(fmt_value(r["metric"], r["a"]))}</td>'
                f'<td class="num">{text(fmt_value(r["metric"], r["b"]))}</td><td class="num {cls}">{ratio}</td>'
                f'<td class="{cls}">{text(verdict_text(r))}</td></tr>'
            )
        na, nb = noise_cells(res)
        rows.append(
            f"<tr><th>noise (block spread)</th><td>{text(na)}</td><td>{text(nb)}</td><td></td><td></td></tr>"
        )
        diffs = (
            "".join(
                f"<tr><td>{text(d['setting'])}</td><td>{text(d['a'])}</td><td>{text(d['b'])}</td></tr>"
                for d in res["settings_differ"]
            )
            or '<tr><td colspan="3" class="muted">no recorded setting differs</td></tr>'
        )
        parts.append(
            f"<h3>{text(base.name)} (A) → {text(other.name)} (B)</h3>"
            f'<p class="muted">{text(basis_line(res))}</p>'
            f"<table><tr><th>metric</th><th>A</th><th>B</th><th>B/A</th><th>verdict</th></tr>{''.join(rows)}</table>"
            + "".join(f"<p><b>Note:</b> {text(n)}</p>" for n in res.get("notes") or [])
            + f"<p>Settings that differ:</p><table><tr><th>setting</th><th>A</th><th>B</th></tr>{diffs}</table>"
        )
    return "".join(parts)


def render(runs: list[LoadedRun], price: float | None = None, title: str | None = None) -> str:
    """The report as one HTML string."""
    names = ", ".join(r.name for r in runs)
    title = title or f"pitstop report: {names}"
    loss = line_chart(
        "loss",
        "training loss",
        [(r.name, series(r, "loss")) for r in runs],
        "optimizer step",
        "loss",
    )
    tps = line_chart(
        "tokens_per_second",
        "throughput",
        [(r.name, tokens_per_second_series(r)) for r in runs],
        "optimizer step",
        "tokens/s",
        y0=True,
    )
    mem_lines = [(r.name, memory_series(r)) for r in runs]
    if any(pts for _, pts in mem_lines):
        mem = line_chart(
            "memory", "memory", [(n, p) for n, p in mem_lines], "optimizer step", "bytes", y0=True
        )
    else:
        mem = ""
    peaks = [
        (r.name, float(r.summary.peak_memory_bytes))
        for r in runs
        if r.summary.peak_memory_bytes is not None
    ]
    mem += hbars("peak_memory", "peak memory per run", peaks, "bytes")
    breakdowns = []
    for r in runs:
        steps = [(float(s.step), s.phases) for s in r.steps]
        steps = [(s, ph) for s, ph in steps if ph]
        breakdowns.append(
            stacked_bars(f"breakdown-{r.name}", f"step time by phase: {r.name}", steps)
        )
        tb = breakdown(r.summary)
        if tb:
            total = sum(tb.values()) or 1.0
            cells = "".join(
                f'<tr><td>{text(k)}</td><td class="num">{v:,.2f} s</td><td class="num">{v / total:.1%}</td></tr>'
                for k, v in sorted(tb.items(), key=lambda kv: -kv[1])
            )
            breakdowns.append(
                f"<table><tr><th>phase (whole run)</th><th>seconds</th><th>share</th></tr>{cells}</table>"
            )
    body = [
        f"<h1>{text(title)}</h1>",
        f'<p class="muted">written {time.strftime("%Y-%m-%d %H:%M")} by pitstop; runs: '
        + ", ".join(f"<code>{text(r.path)}</code>" for r in runs)
        + "</p>",
        "<h2>Summary</h2>",
        _summary_table(runs, price),
        "<h2>Cost</h2>",
        _cost_section(runs, price),
        "<h2>Loss and throughput</h2>",
        f'<div class="charts">{loss}{tps}</div>',
        "<h2>Where each step's time goes</h2>",
        "".join(breakdowns),
        "<h2>Memory</h2>",
        f'<div class="charts">{mem}</div>',
        "<h2>Findings</h2>",
        "".join(_findings(r) for r in runs),
    ]
    if len(runs) > 1:
        body += ["<h2>Comparison</h2>", _comparison(runs, price)]
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{text(title)}</title>'
        f"<style>{CSS}</style></head><body>{''.join(body)}</body></html>"
    )


def write_report(
    run_dirs: list[str | Path] | str | Path, output: str | Path, price: float | None = None
) -> Path:
    """Write the HTML report of one or more run directories to `output`; return its path."""
    dirs = [run_dirs] if isinstance(run_dirs, (str, Path)) else list(run_dirs)
    runs = [load_run(d) for d in dirs]
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    tmp.write_text(render(runs, price), encoding="utf-8")
    os.replace(tmp, out)  # a reader never sees half a report
    return out
