"""`pitstop profile` as a library: run W warm-up + K steps of a config and measure them.

The steps run through the real trainer (`pitstop.train.trainer.Trainer`), so what is
measured is exactly what `pitstop train` would do with the same config: the same
loader, phases, logging cadence and checkpoint policy. The run goes to a temporary
output directory that is removed afterwards; the per-step numbers are read back from
its metrics.jsonl (`<phase>_s`, `step_seconds`, cumulative token counters) and the
FLOPs/peak figures from its summary, the first W steps (allocator warm-up, lazy
initialisation, torch.compile) are dropped, and the rest becomes a
`pitstop.profile/1` dict (`pitstop.measure.schema.make_profile`) with the bottleneck
verdict (`pitstop.measure.verdict`).

The trainer's explicit hooks (`pitstop.train.hooks`, implemented by `StepClock`)
make this possible without touching the loop: the start of each step is stamped (to
know when the measured window starts, for device sampling and for early stopping in
`pitstop tune`), its end steps the torch.profiler schedule, and `save_final=False`
skips the final model a measurement run has no use for (writing it can take minutes
for a large model).
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pitstop.core import host_malloc, run_record
from pitstop.core.config import RunConfig
from pitstop.core.run_record import RunSummary, StepLine, read_steps
from pitstop.measure.flops import mfu as mfu_of
from pitstop.measure.memory import peak_memory, reset_peak_memory
from pitstop.measure.sampler import Sampler, SamplerSummary
from pitstop.measure.schema import make_profile
from pitstop.measure.timeline import PHASES
from pitstop.measure.verdict import Verdict, format_verdict, verdict
from pitstop.train.signals import RunInterrupted

if TYPE_CHECKING:  # the trainer imports torch; this module is read without it
    from pitstop.train.trainer import Trainer

# At most this many measured steps go into a Chrome trace: a trace of a real model
# grows by tens of MB per step, and a few steps show the pattern.
TRACE_MAX_STEPS = 5


# --- the trainer, instrumented ------------------------------------------------------


@dataclass
class StepClock:
    """Host timestamps of the start of each optimizer step (its first fetch_batch).

    `on_step_start(step_index, clock)` may return True to make the step being started
    the last one (used by `pitstop tune` to stop once the median is stable).
    """

    starts: list[float] = field(default_factory=list)
    end: float | None = None
    on_step_start: Callable[[int, StepClock], bool] | None = None
    on_step_end: Callable[[int], None] | None = None

    def step_started(self) -> bool:
        """`pitstop.train.hooks.StepHooks`: stamp the step's start; True stops after it."""
        idx = len(self.starts)
        self.starts.append(time.perf_counter())
        return bool(self.on_step_start is not None and self.on_step_start(idx, self))

    def step_ended(self, step: int) -> None:
        """`pitstop.train.hooks.StepHooks`: stamp the end of the last optimizer update."""
        self.end = time.perf_counter()
        if self.on_step_end is not None:
            self.on_step_end(step)


def measured_trainer(cfg: RunConfig, clock: StepClock, **kwargs: Any) -> Trainer:
    """A `Trainer` that reports step boundaries to `clock` and writes no final model."""
    from pitstop.train.trainer import Trainer

    return Trainer.from_config(cfg, hooks=clock, save_final=False, **kwargs)


def measurement_config(cfg: RunConfig, out_dir: Path, total_steps: int) -> RunConfig:
    """`cfg` redirected to a scratch output directory for `total_steps` steps."""
    return dataclasses.replace(
        cfg,
        output=str(out_dir),
        overwrite=True,
        resume=False,
        max_steps=total_steps,
        epochs=None,
        report_to=["none"],  # TensorBoard files are not part of the step's cost worth keeping
        eval_data=None,  # evaluation would run inside the measured steps
        eval_steps=None,
    )


# --- the profile -------------------------------------------------------------------


def step_spread(step_seconds: list[float]) -> dict[str, float]:
    """Median, 10th/90th percentile, min and max of step times (seconds)."""
    if not step_seconds:
        return {}
    a = np.asarray(step_seconds, dtype=float)
    return {
        "median_seconds": float(np.median(a)),
        "p10_seconds": float(np.percentile(a, 10)),
        "p90_seconds": float(np.percentile(a, 90)),
        "min_seconds": float(a.min()),
        "max_seconds": float(a.max()),
    }


def window_utilisation(samples: list[dict[str, float]], t0: float, t1: float) -> dict[str, Any]:
    """`Sampler.summary()`-shaped means/maxima over the samples taken in [t0, t1]."""
    inside = [s for s in samples if t0 <= s["t"] <= t1]
    out: dict[str, Any] = {"samples": len(inside), "window_seconds": round(t1 - t0, 3)}
    for k in sorted({k for s in inside for k in s} - {"t"}):
        vals = [s[k] for s in inside if k in s]
        out[k] = {"mean": sum(vals) / len(vals), "max": max(vals)}
    return out


def _trace_context(trace_dir: Path | None, warmup: int, steps: int, cuda: bool) -> Any:
    """A torch.profiler stepped once per optimizer step, recording measured steps only."""
    if trace_dir is None:
        return None
    import torch.profiler as tp

    trace_dir.mkdir(parents=True, exist_ok=True)
    active = min(steps, TRACE_MAX_STEPS)
    # Steps before the window are skipped (wait) except the last one, which warms the
    # profiler up (its data is discarded) so the first traced step is not distorted.
    warm = 1 if warmup >= 1 else 0
    path = trace_dir / f"trace-steps-{warmup + 1}-{warmup + active}.json"
    activities = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if cuda else [])
    prof = tp.profile(
        activities=activities,
        schedule=tp.schedule(wait=warmup - warm, warmup=warm, active=active, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(str(path)),
    )
    prof.trace_path = path  # type: ignore[attr-defined]
    return prof


@dataclass
class ProfileRun:
    """What `run_profile` measured: the profile dict, the run's summary, the trace file."""

    profile: dict[str, Any]
    summary: RunSummary
    trace_path: Path | None = None


def run_profile(
    cfg: RunConfig,
    *,
    steps: int,
    warmup: int = 2,
    trace_dir: str | Path | None = None,
    loader: Any = None,
    device: Any = None,
    sample_interval_s: float = 0.25,
) -> ProfileRun:
    """Run `warmup` + `steps` optimizer steps of `cfg` and profile the last `steps`.

    `loader` / `device` go to the Trainer (tests pass a slow loader or a pretend
    device). The run writes only to a temporary directory, removed at the end.
    In steps: the run (`_run_steps`), the measured steps' phases and seconds, their MFU
    (`_measured_mfu`), the device's utilisation over them (`_utilisation`), the profile
    with its notes, then its spread and verdict.
    """
    if steps < 1:
        raise ValueError("steps must be at least 1")
    if warmup < 0:
        raise ValueError("warmup must be 0 or more")
    run = _run_steps(
        cfg,
        warmup=warmup,
        steps=steps,
        trace_dir=Path(trace_dir) if trace_dir else None,
        trainer_kwargs={k: v for k, v in (("loader", loader), ("device", device)) if v is not None},
        sample_interval_s=sample_interval_s,
    )
    lines = sorted(run.lines, key=lambda r: r.step)
    measured = [r for r in lines if r.step > warmup]
    step_phases = [{p: r.phases.get(p, 0.0) for p in PHASES} for r in measured]
    step_seconds = [r.seconds or 0.0 for r in measured]
    summary = run.summary
    notes: list[str] = []
    util = _utilisation(run, warmup, notes)
    if run.trace_path is not None:
        notes.append(
            f"torch.profiler traced steps {warmup + 1}-{warmup + min(steps, TRACE_MAX_STEPS)}; "
            "profiling slows the steps it records, so compare timings without --trace"
        )
    if len(measured) < steps:
        notes.append(f"only {len(measured)} of {steps} measured steps ran")
    profile = make_profile(
        step_phases,
        step_seconds,
        warmup=warmup,
        source="pitstop",
        trained_tokens=sum(int(r.step_trained_tokens or 0) for r in measured),
        mfu=_measured_mfu(lines, warmup, sum(step_seconds), summary),
        peak_memory_bytes=run.peak or int(summary.peak_memory_bytes or 0),
        device=summary.device if isinstance(summary.device, dict) else None,
        choices=summary.choices,
        config=cfg.to_dict(),
        events={
            "checkpoints": sum(1 for r in step_phases if r["checkpoint"] > 0),
            "evals": sum(1 for r in step_phases if r["eval"] > 0),
            "logs": sum(1 for r in step_phases if r["logging"] > 0),
        },
        utilisation=util,
        notes=notes,
    )
    profile["step_spread"] = step_spread(step_seconds)
    on_cpu = isinstance(summary.device, dict) and summary.device.get("type") == "cpu"
    if on_cpu and summary.host_page_faults_per_step is not None:
        profile.update(host_malloc.fault_record(summary.host_page_faults_per_step))
    profile["verdict"] = verdict(profile).to_dict()
    trace = run.trace_path
    return ProfileRun(profile, summary, trace if trace and trace.exists() else None)


@dataclass
class _StepsRun:
    """What the instrumented run left: its summary and step lines (read before its
    directory was removed), the device's peak memory, the step clock, the sampler and
    when it started, and the trace file (None without --trace)."""

    summary: RunSummary
    lines: list[StepLine]
    peak: int | None
    clock: StepClock
    sampler: Sampler
    sampler_start: float  # time.perf_counter() when sampling began (about)
    trace_path: Path | None


def _run_steps(
    cfg: RunConfig,
    *,
    warmup: int,
    steps: int,
    trace_dir: Path | None,
    trainer_kwargs: dict[str, object],
    sample_interval_s: float,
) -> _StepsRun:
    """`warmup` + `steps` optimizer steps of `cfg` through the trainer, in a temporary
    output directory removed afterwards, with the step clock, the device sampler and
    (given `trace_dir`) torch.profiler around them."""
    tmp = Path(tempfile.mkdtemp(prefix="pitstop-profile-"))
    try:
        run_cfg = measurement_config(cfg, tmp / "run", warmup + steps)
        clock = StepClock()
        trainer = measured_trainer(run_cfg, clock, **trainer_kwargs)
        cuda = trainer.run.device.type == "cuda"
        prof = _trace_context(trace_dir, warmup, steps, cuda)
        if prof is not None:
            clock.on_step_end = lambda _step: prof.step()
        gpu_index = (trainer.run.device.index or 0) if cuda else None
        sampler = Sampler(sample_interval_s, gpu_index=gpu_index)
        reset_peak_memory(trainer.run.device.type)
        ctx: AbstractContextManager[Any] = prof if prof is not None else nullcontext()
        t_sampler0 = time.perf_counter()  # the sampler's samples count from (about) here
        with sampler, ctx:
            try:
                summary = trainer.fit()
            except RunInterrupted as e:
                # Its checkpoint is in the scratch directory removed below: no resume hint.
                raise RunInterrupted(
                    f"{e.stopped}, before the profile was complete: nothing was "
                    "written (a profile is written only once its steps are measured)",
                    e.exit_code,
                ) from None
        peak = peak_memory(trainer.run.device.type)
        lines = read_steps(tmp / "run" / run_record.METRICS)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    trace_path = getattr(prof, "trace_path", None) if prof is not None else None
    return _StepsRun(summary, lines, peak, clock, sampler, t_sampler0, trace_path)


def _measured_mfu(
    lines: list[StepLine], warmup: int, seconds: float, summary: RunSummary
) -> float | None:
    """Model FLOPs utilisation of the measured steps: the positions they computed (padded
    tokens after the warm-up) per second, against the run's FLOPs per token and peak."""
    measured = [r for r in lines if r.step > warmup]
    before = [r for r in lines if r.step == warmup]
    padded0 = int(before[0].padded_tokens or 0) if before else 0
    positions = int(measured[-1].padded_tokens or 0) - padded0 if measured else 0
    if seconds > 0 and summary.flops_per_token:
        return mfu_of(positions / seconds, float(summary.flops_per_token), summary.peak_flops)
    return None


def _utilisation(
    run: _StepsRun, warmup: int, notes: list[str]
) -> SamplerSummary | dict[str, object]:
    """Device utilisation over the measured steps only (the sampler's clock starts at its
    start), else over the whole run when they were shorter than one sample (noted)."""
    starts, clock, sampler = run.clock.starts, run.clock, run.sampler
    if len(starts) <= warmup or clock.end is None:
        return sampler.summary()
    w0, w1 = starts[warmup] - run.sampler_start, clock.end - run.sampler_start
    win = window_utilisation(sampler.samples, w0, w1)
    if win["samples"]:
        return {**win, "interval_s": sampler.interval_s, "gpu": sampler.gpu_status}
    notes.append(
        f"the measured steps took {w1 - w0:.2f} s, shorter than one {sampler.interval_s} s "
        "sample: device utilisation covers the whole run, model loading included"
    )
    return sampler.summary()


# --- the terminal report ------------------------------------------------------------


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def format_profile(profile: dict[str, Any]) -> str:
    """The breakdown a user reads: phases, throughput, spread, MFU, memory, utilisation, verdict."""

    p = profile
    k = int(p["steps"])
    total = float(sum(p["step_seconds"])) or 1.0
    mfu = f", MFU {100 * p['mfu']:.1f}%" if p.get("mfu") is not None else ", MFU n/a"
    lines = [
        f"pitstop profile: {k} steps measured after {p['warmup']} warm-up step(s): "
        f"{p['tokens_per_second']:,.0f} tokens/s{mfu}",
        "",
        f"  {'phase':<16}{'seconds':>10}{'share':>8}{'per step':>12}",
    ]
    for name in PHASES:
        sec = float(p["phases"].get(name, 0.0))
        lines.append(f"  {name:<16}{sec:>10.4f}{100 * sec / total:>7.1f}%{sec / max(k, 1):>11.4f}s")
    lines.append(f"  {'total':<16}{total:>10.4f}{100.0:>7.1f}%{total / max(k, 1):>11.4f}s")
    sp = p.get("step_spread") or step_spread(list(p["step_seconds"]))
    if sp:
        lines += [
            "",
            f"step time: median {sp['median_seconds']:.4f} s, p10 {sp['p10_seconds']:.4f} s, "
            f"p90 {sp['p90_seconds']:.4f} s, min {sp['min_seconds']:.4f} s, "
            f"max {sp['max_seconds']:.4f} s",
        ]
    dev = p.get("device") or {}
    dev_type = dev.get("type") if isinstance(dev, dict) else dev  # a bare name: hand-written
    kind = "peak CUDA memory allocated" if dev_type == "cuda" else "peak resident memory"
    lines.append(f"memory: {_gib(p.get('peak_memory_bytes') or 0)} ({kind})")
    u = p.get("utilisation") or {}
    parts = []
    if "process_cpu_percent" in u:
        parts.append(f"this process {u['process_cpu_percent']['mean']:.0f}% of one core (mean)")
    if "cpu_percent" in u:
        parts.append(f"machine CPU {u['cpu_percent']['mean']:.0f}%")
    if "gpu_util_percent" in u:
        parts.append(f"GPU {u['gpu_util_percent']['mean']:.0f}% busy")
    if "gpu_power_watts" in u:
        parts.append(f"{u['gpu_power_watts']['mean']:.0f} W")
    if parts:
        lines.append(f"utilisation ({u.get('samples', 0)} samples): " + ", ".join(parts))
    ev = p.get("events") or {}
    if ev:
        lines.append(
            "events in the measured steps: "
            + ", ".join(f"{n} {name}" for name, n in ev.items() if name)
        )
    v = p.get("verdict")
    vd = Verdict(**{**v, "also": [Verdict(**a) for a in v.get("also", [])]}) if v else verdict(p)
    lines += ["", format_verdict(vd)]
    ev_items = {k: val for k, val in vd.evidence.items() if k not in ("shares", "thresholds")}
    lines.append("  evidence: " + ", ".join(f"{k}={val}" for k, val in ev_items.items()))
    for note in p.get("notes") or []:
        lines.append(f"note: {note}")
    return "\n".join(lines)
