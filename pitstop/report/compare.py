"""`pitstop compare`: a before/after table of two runs, and the settings that differ.

Speed figures are steady (pitstop.report.steady): warm-up steps left out, then the
trained tokens of the remaining steps over their seconds, so one slow warm-up step does
not decide the comparison and a stall that recurs (a loader's workers all busy every Nth
step) is counted as the run pays it. Each timing ratio B/A carries a noise band from both
runs' block rates; inside it the verdict is "no measurable difference", never better or
worse. Each run's noise (its block spread, the machine's load, the doctor's
`noisy-machine` finding) is a row of the table.

Under torchrun the token figures are the run's totals over every rank (a run whose writer
counts rank 0's batches, RunSummary.ranks_counted, is scaled by its world size), with a
per-rank tokens/s row beside them; a changed world size changes the effective batch, and
the notes say so.

Totals (train time, wall time, cost) come from summary.json: cost = wall_seconds × GPUs ×
price per GPU-hour (you pay for the whole process). A total is judged only when both runs
trained the same number of tokens (within TOKENS_TOLERANCE); otherwise the per-token rows
(cost per 1M trained tokens, tokens/s) carry the verdict. data-wait share =
the steady steps' data_wait / their seconds (summary.json's time_breakdown where the steps
have no phases); padding waste = 1 − seen / padded tokens.
Ratios are B / A.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from pitstop.core.run_record import RunSummary
from pitstop.report.runs import LoadedRun, breakdown, flat_settings, load_run
from pitstop.report.steady import Steady, band, steady, steady_lines


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    unit: str
    higher_is_better: bool | None  # None: neither (e.g. loss at different settings)
    # how a difference is judged: "timing" (the noise band), "total" (the band, and only for
    # equal trained tokens), "per_step" (the band, and only for equal tokens per step),
    # "exact" (a deterministic figure: 0.5% threshold), "share" (2 percentage points), "none"
    kind: str = "exact"


METRICS = [
    Metric("tokens_per_second", "tokens/s (steady, all ranks)", "tok/s", True, "timing"),
    Metric("rank_tokens_per_second", "tokens/s per rank (steady)", "tok/s", True, "timing"),
    Metric("iterations_per_second", "optimizer steps/s (steady)", "it/s", True, "per_step"),
    Metric("world_size", "processes (world size)", "", None, "none"),
    Metric("trained_tokens_per_step", "trained tokens/step (all ranks)", "tok", None, "none"),
    Metric("trained_tokens", "trained tokens (all ranks)", "tok", None, "none"),
    Metric("cost_per_mtok", "cost per 1M trained tokens", "USD", False, "timing"),
    Metric("train_seconds", "train time (total)", "s", False, "total"),
    Metric("wall_seconds", "wall time (total)", "s", False, "total"),
    Metric("cost", "cost (total)", "USD", False, "total"),
    Metric("mfu", "MFU", "", True, "timing"),
    Metric("peak_memory_bytes", "peak memory", "bytes", False, "exact"),
    Metric("data_wait_share", "data-wait share", "", False, "share"),
    Metric("padding_waste", "padding waste", "", False, "exact"),
    Metric("final_loss", "final loss", "", None, "none"),
]
# Trained tokens (per step, or in all) that differ by more than this are different work.
TOKENS_TOLERANCE = 0.02
EXACT_THRESHOLD = 0.005  # a deterministic figure (memory, padding) differs beyond 0.5%
SHARE_THRESHOLD = 0.02  # a share (data wait) differs beyond 2 percentage points

NO_DIFFERENCE = "no measurable difference"
DIFFERENT_WORK = "not comparable: different trained tokens"


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


def run_metrics(
    run: LoadedRun, price: float | None = None, st: Steady | None = None
) -> dict[str, float | None]:
    """The compared figures of one run (None where the run did not record what is needed).

    Speeds are steady (trained tokens over seconds after the warm-up) when the run has
    enough steady steps (`st`), else whole-run. Token figures are totals over the ranks.
    """
    s = run.summary
    train, wall = _num(s.train_seconds), _num(s.wall_seconds)
    ranks = gpu_count(s)
    scale = s.whole_run_factor  # a writer that counts rank 0's batches: x world size
    trained = _num(s.trained_tokens)
    tps = _num(s.tokens_per_second)
    if tps is None and train and trained:
        tps = trained / train
    steps = _num(s.optimizer_steps)
    its = steps / train if steps and train else None
    if st is not None:
        its = 1.0 / st.step_seconds
        tps = st.tokens_per_second if st.tokens_per_second is not None else tps
    trained = trained * scale if trained is not None else None
    tps = tps * scale if tps is not None else None
    tb = breakdown(s)
    total = sum(tb.values())
    steady_steps = steady_lines(run) if st is not None else []
    if any(r.phases for r in steady_steps):  # the same steps as the throughput
        tb = {"data_wait": sum(r.data_wait_s for r in steady_steps)}
        total = sum(float(r.seconds or 0.0) for r in steady_steps)
    seen, padded = _num(s.seen_tokens), _num(s.padded_tokens)
    secs_paid = wall or train
    cost = secs_paid / 3600 * gpu_count(s) * price if (price is not None and secs_paid) else None
    return {
        "tokens_per_second": tps,
        "rank_tokens_per_second": tps / ranks if tps is not None else None,
        "iterations_per_second": its,
        "world_size": float(ranks),
        "trained_tokens_per_step": trained / steps if steps and trained else None,
        "trained_tokens": trained,
        "cost_per_mtok": cost / trained * 1e6 if (cost is not None and trained) else None,
        "train_seconds": train,
        "wall_seconds": wall,
        "cost": cost,
        "mfu": _num(s.mfu),
        "peak_memory_bytes": _num(s.peak_memory_bytes),
        "data_wait_share": tb.get("data_wait", 0.0) / total if total else None,
        "padding_waste": 1 - seen / padded if (seen is not None and padded) else None,
        "final_loss": _num(s.final_loss),
    }


def _same(x: float | None, y: float | None) -> bool:
    return bool(x and y) and abs(y / x - 1) <= TOKENS_TOLERANCE  # type: ignore[operator]


def judge(
    m: Metric,
    va: float | None,
    vb: float | None,
    bounds: tuple[float, float] | None,
    same_work: bool,
    same_step: bool,
) -> tuple[float | None, str | None, bool | None]:
    """(ratio B/A, verdict, b_better) of one metric; see the module docstring."""
    ratio = vb / va if (va is not None and vb is not None and va != 0) else None
    if ratio is None or m.higher_is_better is None or m.kind == "none":
        return ratio, None, None
    if m.kind == "total" and not same_work:
        return ratio, DIFFERENT_WORK, None
    if m.kind == "per_step" and not same_step:
        return ratio, "not comparable: different tokens per step", None
    if m.kind == "share":
        moved = abs(vb - va) > SHARE_THRESHOLD  # type: ignore[operator]
    elif m.kind == "exact":
        moved = abs(ratio - 1) > EXACT_THRESHOLD
    else:
        if bounds is None:
            return ratio, "no noise band (too few steps)", None
        moved = not bounds[0] <= ratio <= bounds[1]
    if not moved:
        return ratio, NO_DIFFERENCE if m.kind != "exact" else "same", None
    better = ((vb > va) if m.kind == "share" else (ratio > 1)) == m.higher_is_better  # type: ignore[operator]
    return ratio, "better" if better else "worse", better


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
    # A run of `pitstop profile -- COMMAND` is set up by its command line.
    ca, cb = a.summary.command, b.summary.command
    if (ca or cb) and ca != cb:
        out.append(("command", _command_text(ca), _command_text(cb)))
    return out


def _command_text(cmd: list[str] | None) -> str:
    return " ".join(cmd) if cmd else "-"


class MetricRow(TypedDict):
    """One metric of the comparison: A, B, B/A, its noise band (timing rows) and verdict."""

    metric: str
    label: str
    unit: str
    a: float | None
    b: float | None
    ratio: float | None
    band: list[float] | None
    verdict: str | None
    b_better: bool | None


class SteadyBasis(TypedDict):
    """One run's steady-state basis as the comparison reports it."""

    steps: int
    warmup_steps: int
    mean_step_seconds: float
    tokens_per_second: float | None
    blocks: int
    block_spread: float
    noisy: list[str]


class SettingDiff(TypedDict):
    setting: str
    a: Any  # a recorded setting's value, as the run's config holds it
    b: Any


class Comparison(TypedDict):
    """`compare`'s result: what `pitstop compare --json` prints and the tables are made of."""

    a: str
    b: str
    price_per_gpu_hour: float | None
    steady: dict[str, SteadyBasis | None]  # "a", "b"
    noise_band: list[float] | None
    metrics: list[MetricRow]
    notes: list[str]
    settings_differ: list[SettingDiff]


def compare(
    a: str | Path | LoadedRun, b: str | Path | LoadedRun, price: float | None = None
) -> Comparison:
    """The comparison as data: per metric A, B, B/A, its noise band and verdict; each run's
    steady-state basis and noise; the settings that differ."""
    ra = a if isinstance(a, LoadedRun) else load_run(a)
    rb = b if isinstance(b, LoadedRun) else load_run(b)
    sa, sb = steady(ra), steady(rb)
    ma, mb = run_metrics(ra, price, sa), run_metrics(rb, price, sb)
    bounds = band(sa, sb)
    same_work = _same(ma["trained_tokens"], mb["trained_tokens"])
    same_step = _same(ma["trained_tokens_per_step"], mb["trained_tokens_per_step"])
    rows: list[MetricRow] = []
    for m in METRICS:
        va, vb = ma[m.key], mb[m.key]
        ratio, verdict, better = judge(m, va, vb, bounds, same_work, same_step)
        banded = m.kind in ("timing", "total", "per_step") and bounds is not None
        row = MetricRow(
            metric=m.key,
            label=m.label,
            unit=m.unit,
            a=va,
            b=vb,
            ratio=ratio,
            band=list(bounds) if banded and bounds is not None else None,
            verdict=verdict,
            b_better=better,
        )
        rows.append(row)
    diffs = setting_differences(ra, rb)
    return Comparison(
        a=str(ra.path),
        b=str(rb.path),
        price_per_gpu_hour=price,
        steady={"a": _steady_basis(sa), "b": _steady_basis(sb)},
        noise_band=list(bounds) if bounds is not None else None,
        metrics=rows,
        notes=_notes(ma, mb, ra, rb, sa, sb, same_work, bool(diffs)),
        settings_differ=[SettingDiff(setting=k, a=x, b=y) for k, x, y in diffs],
    )


def _steady_basis(st: Steady | None) -> SteadyBasis | None:
    if st is None:
        return None
    return SteadyBasis(
        steps=st.steps,
        warmup_steps=st.warmup,
        mean_step_seconds=st.step_seconds,
        tokens_per_second=st.tokens_per_second,
        blocks=st.blocks,
        block_spread=st.spread,
        noisy=st.noisy,
    )


def basis_line(result: Comparison) -> str:
    """Where the speed figures come from, and how wide the noise band is."""
    parts = []
    for side in ("a", "b"):
        st = result["steady"][side]
        if st is None:
            parts.append(f"{side.upper()}: whole-run means (too few steps for steady figures)")
        else:
            parts.append(
                f"{side.upper()}: tokens over seconds of {st['steps']} steady steps, stalls "
                f"included ({st['warmup_steps']} warm-up step(s) left out)"
            )
    bounds = result.get("noise_band")
    band_txt = (
        f"noise band {bounds[0]:.3f}-{bounds[1]:.3f}x (both runs' rates over blocks of steps; "
        f"inside it: {NO_DIFFERENCE})"
        if bounds is not None
        else "no noise band"
    )
    return "\n".join(["speed: " + "; ".join(parts), band_txt])


def noise_cells(result: Comparison) -> tuple[str, str]:
    """The table's noise row: each run's block spread and what flags it noisy."""
    out = []
    for side in ("a", "b"):
        st = result["steady"][side]
        if st is None:
            out.append("-")
            continue
        txt = f"spread {st['block_spread']:.0%} over {st['blocks']} blocks"
        out.append(txt + (" NOISY: " + ", ".join(st["noisy"]) if st["noisy"] else ", quiet"))
    return out[0], out[1]


def _notes(
    ma: dict[str, float | None],
    mb: dict[str, float | None],
    ra: LoadedRun,
    rb: LoadedRun,
    sa: Steady | None,
    sb: Steady | None,
    same_work: bool,
    settings_differ: bool,
) -> list[str]:
    """What a reader must know before taking a ratio as a speed-up."""
    out = []
    wa, wb = ma["world_size"], mb["world_size"]
    if wa and wb and wa != wb:
        ra_, rb_ = ma["rank_tokens_per_second"], mb["rank_tokens_per_second"]
        per_rank = f" (per rank {rb_ / ra_:.2f}x)" if ra_ and rb_ else ""
        out.append(
            f"A ran {wa:.0f} process(es), B {wb:.0f}: tokens/s and tokens per step are totals "
            f"over the ranks{per_rank}. More processes with the same per-rank batch train more "
            "tokens per optimizer step: the effective batch changed"
        )
    ta, tb = ma["trained_tokens_per_step"], mb["trained_tokens_per_step"]
    if ta and tb and abs(tb / ta - 1) > TOKENS_TOLERANCE:
        fewer = "fewer" if tb < ta else "more"
        out.append(
            f"B's optimizer step holds {fewer} trained tokens than A's ({tb:,.0f} vs {ta:,.0f}, "
            f"{tb / ta:.2f}x): a faster step is not a speed-up when the step holds fewer tokens. "
            "Compare trained tokens/s; the runs also learn differently (another effective "
            "batch: retune the learning rate, or keep tokens per step equal)"
        )
    xa, xb = ma["trained_tokens"], mb["trained_tokens"]
    if xa and xb and not same_work:
        out.append(
            f"the runs trained different numbers of tokens ({xa:,.0f} vs {xb:,.0f}): total time "
            "and cost are not judged; compare the per-token rows (tokens/s, cost per 1M "
            "trained tokens)"
        )
    noisy = [(r, st) for r, st in ((ra, sa), (rb, sb)) if st is not None and st.noisy]
    for r, st in noisy:
        out.append(
            f"{r.path} was measured on a noisy machine ({', '.join(st.noisy)}): the band is "
            "widened; to settle a close call, rerun both alternately (docs/compare.md)"
        )
    if noisy and not settings_differ:
        out.append(
            "no recorded setting differs and "
            + " and ".join(str(r.path) for r, _ in noisy)
            + " ran on a noisy machine: a timing difference here comes from the machine, not "
            "the configuration; rerun both alternately to compare them (docs/compare.md)"
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
    if key in ("cost", "cost_per_mtok"):
        return f"{v:,.4f} USD" if v < 1 else f"{v:,.2f} USD"
    if key == "final_loss":
        return f"{v:.4f}"
    if key == "iterations_per_second":
        return f"{v:.3f}"
    if key == "trained_tokens_per_step":
        return f"{v:,.1f}"
    return f"{v:,.0f}"


def _ratio(r: MetricRow) -> str:
    if r["ratio"] is None:
        return "-"
    return f"{r['ratio']:.2f}x"


def verdict_text(r: MetricRow) -> str:
    """A row's verdict, with its noise band where it has one."""
    v = r.get("verdict") or ""
    if r.get("band") and v in ("better", "worse", NO_DIFFERENCE):
        v += f" (band {r['band'][0]:.2f}-{r['band'][1]:.2f}x)"
    return v or "-"


def format_compare(result: Comparison, markdown: bool = False) -> str:
    """A plain-text (or Markdown) table of `compare`'s result."""
    head = ["metric", "A", "B", "B/A", "verdict"]
    body = [
        [
            r["label"],
            fmt_value(r["metric"], r["a"]),
            fmt_value(r["metric"], r["b"]),
            _ratio(r),
            verdict_text(r),
        ]
        for r in result["metrics"]
    ]
    body.append(["noise (block spread)", *noise_cells(result), "", ""])
    diffs = [
        [d["setting"], json.dumps(d["a"]), json.dumps(d["b"])] for d in result["settings_differ"]
    ]
    out = [f"A: {result['a']}", f"B: {result['b']}", basis_line(result)]
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
