"""`tune(cfg)`: measure the user's configuration, search, and write the tuned config.

Ties the pieces together: resolves the tokens per optimizer step the user's config
means (kept exactly), measures that configuration as written (the baseline, fresh),
builds the search space for this machine, runs the search within the budget, and
renders the results (table, JSON, tuned.yaml). The YAML is the user's full
RunConfig with only the speed knobs changed, checked by loading it back through
`build_config(..., command="train")`, so `pitstop train --config tuned.yaml` runs it.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pitstop import probe
from pitstop.catalog.layouts import worth_timing
from pitstop.core import log
from pitstop.core.cache_layout import cache_root
from pitstop.core.config import RunConfig, build_config, load_yaml
from pitstop.measure import cost_model
from pitstop.measure.machine import describe_load, machine_load
from pitstop.tune.search import (
    OK,
    OOM,
    SearchResult,
    TrialResult,
    free_memory,
    is_oom,
    safe_measure,
    search,
)
from pitstop.tune.space import (
    KNOBS,
    Settings,
    Space,
    apply_settings,
    build_space,
    resolved_tokens_per_step,
    settings_from_choices,
)
from pitstop.tune.trial import TrialCache, TrialRunner, cache_context

DEFAULT_BUDGET_SECONDS = 180.0
CPU_MEMORY_SHARE = 0.8  # default CPU cap: this share of the RAM available at start


@dataclass
class TuneReport:
    """The search result plus what the command prints and writes."""

    result: SearchResult
    space: Space
    tokens_per_step: int
    memory_limit_bytes: int | None
    memory_limit_source: str
    tuned_config: RunConfig | None = None
    tuned_path: Path | None = None
    machine: dict[str, Any] = field(default_factory=machine_load)  # at the end of the search

    def to_json(self) -> dict[str, Any]:
        r = self.result
        b, w = r.baseline, r.best
        return {
            "trials": [_trial_json(t, self.space) for t in r.trials],
            "baseline": {
                "settings": _settings_json(b.settings, self.space),
                "tokens_per_second": b.tokens_per_second,
                "peak_memory_bytes": b.peak_memory_bytes,
                "status": b.status,
                "measurements": b.measurements,
            },
            "best": None
            if w is None
            else {
                "settings": _settings_json(w.settings, self.space),
                "tokens_per_second": w.tokens_per_second,
                "peak_memory_bytes": w.peak_memory_bytes,
                "measurements": w.measurements,
                "side_by_side": w.extra.get("side_by_side"),
            },
            "speedup": r.speedup,
            "speedup_basis": "both measured in this run, side by side after the search when "
            "the winner is not the start: median step time over stable steps, warm-up and "
            "compile excluded",
            "confirmed": r.confirmed,
            "trial_noise": r.trial_noise,
            "rejected": None
            if r.rejected is None
            else {
                "settings": _settings_json(r.rejected.settings, self.space),
                "tokens_per_second": r.rejected.tokens_per_second,
            },
            "tokens_per_step": self.tokens_per_step,
            "machine": self.machine,
            "memory_limit_bytes": self.memory_limit_bytes,
            "memory_limit_source": self.memory_limit_source,
            "stopped": r.stopped,
            "elapsed_seconds": r.elapsed_seconds,
            "tuned_config": str(self.tuned_path) if self.tuned_path else None,
        }


def _settings_json(s: Settings, space: Space) -> dict[str, Any]:
    return {
        "batching": s.batching,
        "tokens_per_micro_batch": s.micro_rows * space.max_seq_len,
        "micro_batch_rows": s.micro_rows,
        "micro_batches_per_step": space.micro_batches_per_step(s),
        "loader_workers": s.loader_workers,
        "prefetch_factor": s.prefetch_factor,
        "compile": "on" if s.compile else "off",
        "attention": s.attention,
        "gradient_checkpointing": s.gradient_checkpointing,
    }


def _trial_json(t: TrialResult, space: Space) -> dict[str, Any]:
    d = t.to_dict()
    d["settings"] = _settings_json(t.settings, space)
    for bulky in ("extra", "step_times", "step_tokens"):
        d.pop(bulky, None)
    return d


def memory_limit(dev: Any, cap_gb: float | None) -> tuple[int | None, str]:
    """The memory a trial may use: the GPU's, or on CPU a cap (given, or a share of free RAM)."""
    if cap_gb is not None:
        return int(cap_gb * 2**30), f"--memory-cap-gb {cap_gb:g}"
    if dev.type == "cuda" and dev.total_memory_bytes:
        # The allocator's peak never sees the CUDA context: it is taken off first, as the
        # cost model does for the doctor and `pitstop estimate` (then the same headroom).
        limit = cost_model.usable_bytes(int(dev.total_memory_bytes), cuda=True, headroom=0.0)
        return limit, (
            f"{dev.name} memory less {cost_model.CUDA_CONTEXT_BYTES / 2**30:g} GiB CUDA context"
        )
    import psutil

    avail = psutil.virtual_memory().available
    rss = psutil.Process().memory_info().rss
    # This process's own resident memory counts toward a trial's peak RSS, so it is added back.
    return int(rss + CPU_MEMORY_SHARE * avail), (
        f"{CPU_MEMORY_SHARE:.0%} of the RAM available at start plus this process "
        "(set --memory-cap-gb to change)"
    )


def _real_run_would_compile(cfg: RunConfig, dev: Any, baseline: TrialResult, tps: int) -> bool:
    """Whether `compile: auto` compiles the user's real (long) run, by the trainer's own rule."""

    ex = baseline.extra
    spe = int(ex.get("steps_per_epoch") or 1)
    steps = cfg.max_steps or math.ceil((cfg.epochs or 1.0) * spe)
    peak, fpt = ex.get("peak_flops"), ex.get("flops_per_token")
    if not peak or not fpt:
        return False
    est = probe.estimated_run_seconds(steps, tps, fpt, peak)
    return bool(probe.choose_compile("auto", dev, est, steps=steps).value)


def _warm_process(runner: Any, say: Callable[[str], None]) -> float:
    """One short, unmeasured run of the starting config before anything is measured.

    The first training run in a process pays one-time costs in every step, not only in
    its first ones: oneDNN / cuBLAS kernels created per new shape, allocator pools
    growing, lazy imports. On the dev machine a tiny model's first trial ran its steps
    at ~105 ms against ~55 ms in every later trial of the same settings. Measured cold,
    the start would look slow and every later trial would seem a speed-up; a long real
    run spends nearly all its steps warm, so the trials should be warm too.
    """
    # As long as a short trial (warm-up + min_steps): 5 steps were measured not to be
    # enough (the start's first trial still ran ~12% below its recheck in 5 of 6 tunes).
    short = copy.copy(runner)
    short.max_steps = runner.min_steps
    short.max_trial_seconds = min(runner.max_trial_seconds, 15.0)
    t = safe_measure(short, None)  # type: ignore[arg-type]
    say(f"process warm-up (not measured): {t.seconds:.1f} s")
    free_memory()
    return t.seconds


def _measure_start(cfg: RunConfig, runner: Any, dev: Any) -> TrialResult:
    """The user's configuration as written; out of memory is a result, other errors are raised."""

    try:
        return runner(None)
    except Exception as e:
        if not is_oom(e):
            raise  # the user's own config is broken: they need to see why, not a table
        msg = f"{type(e).__name__}: {str(e).strip()[:200]}"
    free_memory()
    # What the config would have resolved to, without the timing `batching: auto` does.
    tps_ok = runner.tokens_per_step % cfg.max_seq_len == 0
    batching = cfg.batching if cfg.batching != "auto" else worth_timing(tps_ok)[0].value
    prec = probe.choose_precision(cfg.precision, dev).value
    choices = {
        "batching": {"value": batching},
        "attention": {"value": probe.choose_attention(cfg.attention, dev, prec).value},
        "compile": {"value": cfg.compile == "on"},
    }
    return TrialResult(settings_from_choices(cfg, choices), status=OOM, error=msg)


def tune(
    cfg: RunConfig,
    *,
    budget_seconds: float = DEFAULT_BUDGET_SECONDS,
    knobs: tuple[str, ...] = KNOBS,
    memory_cap_gb: float | None = None,
    trial_warmup: int = 2,
    trial_steps: int = 30,
    trial_seconds: float | None = None,
    use_cache: bool = True,
    warm_process: bool = True,
    log: Callable[[str], None] | None = None,
) -> TuneReport:
    """Run the tuner on `cfg`; nothing is written (see `write_tuned_config`)."""

    say = log or (lambda _msg: None)
    dev, _ = probe.detect_device(cfg.device)
    tps = resolved_tokens_per_step(cfg)
    per_trial = trial_seconds or min(60.0, max(5.0, budget_seconds / 8))
    runner = TrialRunner(
        cfg,
        tokens_per_step=tps,
        warmup=trial_warmup,
        max_steps=trial_steps,
        max_trial_seconds=per_trial,
        device=dev,
    )
    limit, limit_src = memory_limit(dev, memory_cap_gb)
    say(
        f"tuning for {budget_seconds:.0f} s on {dev.name}: tokens per optimizer step fixed at "
        f"{tps:,}; memory limit {limit / 2**30:.1f} GiB ({limit_src}) with 10% headroom"
        if limit
        else f"tuning for {budget_seconds:.0f} s on {dev.name}"
    )
    warm_seconds = _warm_process(runner, say) if warm_process else 0.0
    baseline = _measure_start(cfg, runner, dev)
    auto_compile = cfg.compile == "auto" and "compile" in knobs
    uncompiled = baseline.status == OK and not baseline.settings.compile
    if auto_compile and uncompiled and _real_run_would_compile(cfg, dev, baseline, tps):
        # The short trial did not compile, but the user's real run would: measure that.
        say("compile: auto would compile the full-length run; measuring the baseline compiled")
        compiled = safe_measure(runner, baseline.settings.replace(compile=True))
        if compiled.status == OK:  # a failed compile falls back to eager in the real run too
            baseline = compiled
    say(_trial_line(1, baseline, "baseline"))
    space = build_space(cfg, dev, tps, knobs=knobs, baseline=baseline.settings)
    cache = (
        TrialCache(cache_root(cfg.cache_dir), cache_context(cfg, dev, runner))
        if use_cache
        else None
    )
    counter = [1]

    def on_trial(t: TrialResult) -> None:
        if t is baseline:
            return
        counter[0] += 1
        say(_trial_line(counter[0], t))

    result = search(
        space,
        runner,
        start=baseline,
        budget_seconds=max(0.0, budget_seconds - warm_seconds),
        memory_limit_bytes=limit,
        cache=cache,
        log=on_trial,
    )
    return TuneReport(result, space, tps, limit, limit_src)


def _trial_line(i: int, t: TrialResult, tag: str = "") -> str:
    tok = f"{t.tokens_per_second:,.0f} tokens/s" if t.tokens_per_second else t.status
    tag = tag or (t.role if t.role in ("recheck", "confirm") else "")
    extra = f" [{tag}]" if tag else (" [cached]" if t.cached else "")
    err = f" ({t.error})" if t.error and t.status != OK else ""
    return f"trial {i}: {t.settings.label()}: {tok}{extra}{err}"


def tuned_config(
    cfg: RunConfig, report: TuneReport, *, run_output: str | None, yaml_path: Path
) -> RunConfig:
    """The user's config with the winner's knobs and an output directory `pitstop train` needs."""
    best = report.result.best
    if best is None:
        raise ValueError("no setting fits; nothing to write")
    out = run_output or cfg.output or str(yaml_path.with_name(yaml_path.stem + "-run"))
    tuned = apply_settings(cfg, best.settings, report.tokens_per_step)
    return dataclasses.replace(tuned, output=out, resume=False, overwrite=False)


def write_tuned_config(
    cfg: RunConfig, report: TuneReport, path: str | Path, *, run_output: str | None = None
) -> RunConfig:
    """Write tuned.yaml and check that `pitstop train --config` accepts it as is."""

    p = Path(path)
    tuned = tuned_config(cfg, report, run_output=run_output, yaml_path=p)
    b, w = report.result.baseline, report.result.best
    head = [
        "# written by `pitstop tune`: the starting config with the fastest measured settings;",
        f"# tokens per optimizer step kept at {report.tokens_per_step}.",
    ]
    if report.result.speedup is not None and w is not None and b.tokens_per_second:
        head.append(
            f"# measured in the same run: {w.tokens_per_second:,.0f} vs {b.tokens_per_second:,.0f} "
            f"tokens/s ({report.result.speedup:.2f}x)"
        )
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("\n".join(head) + "\n" + tuned.to_yaml(), encoding="utf-8")
    check = build_config(load_yaml(p), None, source=str(p), command="train")
    if check != tuned:  # pragma: no cover - a YAML round trip that changes a value is a bug
        log.warning(f"pitstop tune: warning: {p} does not load back identically")
    report.tuned_config, report.tuned_path = tuned, p
    return tuned


def format_report(report: TuneReport) -> str:
    """The trial table, the winner and its measured speed-up."""
    lines = [*_trial_table(report), *_failures(report)]
    if report.result.best is None:
        lines.append("no setting fits in memory; nothing written")
        return "\n".join(lines)
    return "\n".join([*lines, "", *_outcome(report)])


def _trial_table(report: TuneReport) -> list[str]:
    """One row per trial in the order run (its settings and figures, the baseline and the
    best marked), and what the columns mean."""
    r, space = report.result, report.space
    head = (
        f"{'#':>3}  {'batching':<8} {'micro-batch':>11} {'accum':>5} {'workers':>7} {'prefetch':>8} "
        f"{'compile':>7} {'attention':<17} {'ckpt':>4} {'tokens/s':>10} {'step s':>8} "
        f"{'spread':>6} {'peak GiB':>8} {'warm-up s':>9}  status"
    )
    lines = [head]
    for i, t in enumerate(r.trials, 1):
        s = t.settings
        tok = f"{t.tokens_per_second:,.0f}" if t.tokens_per_second else "-"
        step = f"{t.step_seconds:.4f}" if t.step_seconds else "-"
        spread = f"{100 * t.spread:.0f}%" if t.spread is not None else "-"
        mem = f"{t.peak_memory_bytes / 2**30:.2f}" if t.peak_memory_bytes else "-"
        warm = f"{t.warmup_seconds:.1f}" if t.warmup_seconds else "-"
        status = t.status + (" (cached)" if t.cached else "")
        if t.role != "search":
            status += f" {'baseline' if t.role == 'start' else t.role}"
        if r.best is not None and t.settings == r.best.settings and t.status == OK:
            status += " BEST"
        lines.append(
            f"{i:>3}  {s.batching:<8} {s.micro_rows * space.max_seq_len:>11,} "
            f"{space.micro_batches_per_step(s):>5} {s.loader_workers:>7} "
            f"{(s.prefetch_factor if s.loader_workers else '-'):>8} "
            f"{('on' if s.compile else 'off'):>7} {s.attention:<17} "
            f"{('on' if s.gradient_checkpointing else 'off'):>4} {tok:>10} {step:>8} {spread:>6} "
            f"{mem:>8} {warm:>9}  {status}"
        )
    lines.append("")
    lines.append(
        f"micro-batch in padded positions (rows of {space.max_seq_len}); accum = micro-batches "
        f"per optimizer step of {report.tokens_per_step:,} tokens (fixed). Warm-up steps "
        "(and compile time) are excluded from tokens/s; step s is the median."
    )
    return lines


def _failures(report: TuneReport) -> list[str]:
    """Each trial that failed, with its error."""
    failed = [t for t in report.result.trials if t.error and t.status != OK]
    return [f"  {t.settings.label()}: {t.status}: {t.error}" for t in failed]


def _outcome(report: TuneReport) -> list[str]:
    """The winner: how it was checked, its figure against the starting config's, the noise
    it had to beat, and why the search stopped."""
    r = report.result
    w, b = r.best, r.baseline
    assert w is not None  # format_report prints "no setting fits" without an outcome
    lines = [
        "recheck: a setting that won its trial, measured again beside the best so far before "
        "it was taken; confirm: the winner and the starting config, alternating, after the "
        "search",
        f"best: {w.settings.label()}: {w.tokens_per_second:,.0f} tokens/s",
    ]
    if r.confirmed is True:
        sbs = w.extra.get("side_by_side") or {}
        lines.append(
            f"confirmed: measured side by side after the search it ran "
            f"{sbs.get('tokens_per_second', 0):,.0f} vs {sbs.get('start_tokens_per_second', 0):,.0f}"
            f" tokens/s for the starting config ({sbs.get('ratio', 0):.2f}x); its figure is that "
            f"ratio times the starting config's figure over its {b.measurements} trials in this "
            "run (the machine's speed drifts; the ratio of two back-to-back runs does not)"
        )
    elif r.confirmed is False and r.rejected is not None:
        x = r.rejected
        lines.append(
            f"not confirmed: {x.settings.label()} won the search but measured "
            f"{x.tokens_per_second or 0:,.0f} vs {b.tokens_per_second or 0:,.0f} tokens/s for "
            "the starting config side by side (within noise): the starting config is kept"
        )
    if r.trial_noise:
        lines.append(
            f"trial-to-trial noise measured in this run: {r.trial_noise:.1%} (one trial of the "
            "same settings vs the next); a change had to beat it, not just the step-time spread"
        )
    if r.speedup is not None:
        lines.append(
            f"speed-up over the starting config: {r.speedup:.2f}x ({w.tokens_per_second:,.0f} vs "
            f"{b.tokens_per_second:,.0f} tokens/s, both measured in this run)"
        )
    load = describe_load(report.machine)
    if load:  # a loaded machine measures slower and noisier figures than a quiet one
        lines.append(f"measured with the machine at {load}")
    else:
        lines.append(f"the starting config did not run ({b.status}): no speed-up to report")
    stop = {
        "converged": "no knob improved any more",
        "budget": "the time budget ran out (raise --budget-seconds to search further)",
        "nothing-fits": "nothing fits",
    }[r.stopped]
    lines.append(f"{len(r.trials)} trials in {r.elapsed_seconds:.0f} s; stopped: {stop}")
    return lines
