"""What a measured run or profile says about throughput: `load_measured` for `--from-profile`.

Reads a profile.json, a run's summary.json (with its metrics.jsonl) or a killed run's
metrics.jsonl through the typed run record, and keeps two rates: the whole-run trained
tokens/s, and the steady rate a long run keeps up (`steps_steady`: the steps after the
warm-up, which `report.steady.split_warmup` decides for compare too, their trained tokens
over their seconds, so a stall or pause that recurs is paid at its cadence, as in compare).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pitstop.core import run_record
from pitstop.core.errors import DataError
from pitstop.core.run_record import RunSummary, StepLine, check_fields, read_steps, read_summary
from pitstop.measure.machine import MachineLoad
from pitstop.report.runs import load_run
from pitstop.report.steady import split_warmup


@dataclass
class SteadyRate:
    """Trained tokens/s of the steady steps of a profile or run, and what it rests on."""

    tokens_per_second: float
    extra_startup_seconds: float  # warm-up steps' time above steady steps (a run dir)
    detail: str


# The fields of a profile.json the estimate reads, and their kinds (a summary.json is read
# as a RunSummary, whose fields are all checked).
_PROFILE_FIELDS = {
    "tokens_per_second": "num",
    "tokens_per_step": "num",
    "step_seconds": "num_list",
    "phases": "num_map",
    "warmup": "int",
    "mfu": "num",
    "device": "dict_or_str",
    "machine": "dict",
    "config": "dict",
}


@dataclass
class Measured:
    """A measured throughput for --from-profile: from a profile.json, a run's summary.json
    (with its metrics.jsonl), or a killed run's metrics.jsonl alone."""

    path: str  # the file the figures come from, for the basis
    tokens_per_second: float  # trained tokens per second over the measured run
    device: str  # the device it was measured on, as a person reads it
    wall_seconds: float | None = None
    train_seconds: float | None = None
    mfu: float | None = None
    time_breakdown: dict[str, float] = field(default_factory=dict)
    machine: MachineLoad | None = None
    config: dict[str, Any] = field(default_factory=dict)
    steady: SteadyRate | None = None  # the median rate after the warm-up, where steps were kept
    tokens_per_step: float | None = None  # trained tokens per optimizer step, where recorded
    choices: dict[str, Any] = field(default_factory=dict)  # the run's recorded choices
    # Ranks whose tokens the run's counts summed (`RunSummary.ranks_counted`): the figures
    # above are already divided by it, so they are one GPU's, as the estimate prices.
    summed_ranks: int = 1


def load_measured(path: str | Path) -> Measured:
    """The measured throughput of a profile.json, a run's summary.json, or a run directory
    (only a tokens/s figure is required; `pitstop.measure.schema.load_profile` reads a
    full profile for the doctor). Summaries and step lines are read through the typed run
    record: a field of the wrong type is a DataError naming it."""
    p = Path(path)
    if p.is_dir():
        for name in (run_record.SUMMARY, run_record.PROFILE):
            if (p / name).is_file():
                p = p / name
                break
        else:
            if not (p / run_record.METRICS).is_file():
                raise DataError(
                    f"{path} holds neither summary.json, profile.json nor metrics.jsonl; give a "
                    "run directory (`pitstop train`, or a Trainer run with PitstopCallback)"
                )
            # A killed run: its summary rebuilt from the step lines.
            metrics = p / run_record.METRICS
            summary = load_run(p).summary
            if not summary.tokens_per_second:
                raise DataError(f"{metrics} records no trained tokens per step")
            return _from_summary(summary, metrics)
    if not p.is_file():
        raise DataError(f"--from-profile {path} does not exist")
    if p.name == run_record.SUMMARY:
        return _from_summary(read_summary(p), p)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{p} is not valid JSON ({e})") from None
    if isinstance(data, dict) and "step_seconds" not in data and "schema" not in data:
        return _from_summary(RunSummary.from_json(data, str(p)), p)  # a summary, renamed
    prof = check_fields(data, _PROFILE_FIELDS, str(p))
    tps = prof.get("tokens_per_second")
    if not tps:
        raise DataError(_NO_RATE.format(p=p))
    return Measured(
        str(p),
        float(tps),
        device_label(prof.get("device")),
        mfu=prof.get("mfu"),
        machine=prof.get("machine"),
        config=prof.get("config") or {},
        steady=_profile_steady(prof),
        tokens_per_step=prof.get("tokens_per_step"),
        time_breakdown=prof.get("phases") or {},
    )


_NO_RATE = (
    "{p} has no tokens_per_second; give a profile.json from `pitstop profile` or a "
    "run directory / summary.json from `pitstop train`"
)


def _from_summary(s: RunSummary, path: Path) -> Measured:
    if not s.tokens_per_second:
        raise DataError(_NO_RATE.format(p=path))
    # `pitstop train` under torchrun sums its ranks' tokens: one GPU's share is 1/ranks of
    # them (a writer that counts rank 0's batches has one GPU's already).
    n = s.ranks_counted
    steady = steps_steady(read_steps(path.with_name(run_record.METRICS)))
    if steady is not None and n > 1:
        steady = SteadyRate(
            steady.tokens_per_second / n,
            steady.extra_startup_seconds,
            f"{steady.detail}, / {n} ranks (the run's counts sum them)",
        )
    per_step = None
    if s.trained_tokens and s.optimizer_steps:
        per_step = s.trained_tokens / s.optimizer_steps / n
    return Measured(
        str(path),
        float(s.tokens_per_second) / n,
        device_label(s.device),
        wall_seconds=s.wall_seconds,
        train_seconds=s.train_seconds,
        mfu=s.mfu,
        time_breakdown=s.time_breakdown,
        machine=s.machine,
        config=s.config,
        steady=steady,
        tokens_per_step=per_step,
        choices=s.choices or {},
        summed_ranks=n,
    )


def _profile_steady(prof: dict[str, Any]) -> SteadyRate | None:
    """The steady rate of a pitstop.profile/1 dict: its steps are already the measured ones
    (the warm-up left out), their mean step holds every stall and pause at its cadence.
    None without per-step times."""
    secs = [float(x) for x in prof.get("step_seconds") or []]
    tokens = float(prof.get("tokens_per_step") or 0.0)
    if not secs or tokens <= 0:
        return None
    return _steady(statistics.fmean(secs), tokens, 0.0, len(secs), int(prof.get("warmup") or 0))


def steps_steady(lines: list[StepLine]) -> SteadyRate | None:
    """The rate a long run keeps up, from a run's step lines: the trained tokens of the
    steps after the warm-up over their seconds.

    A short run's whole-run mean counts its warm-up steps (the first steps of a process
    run slower: kernels are created per new shape, allocator pools grow, torch.compile
    compiles) as if every step of the full run paid them. Nothing else is left out: a
    loader's periodic waits and checkpoint and evaluation pauses recur at the same cadence
    in the full run (a median step would drop them). The warm-up's time above steady
    steps is paid once (start-up). None when there are too few per-step times to use.
    """
    timed = sorted(
        (r for r in lines if r.step_seconds and r.step_trained_tokens is not None),
        key=lambda r: r.step,
    )
    if len(timed) < 3:
        return None
    warm, steady = split_warmup(timed, lambda r: r.warmup is True, min_steady=2)
    if len(steady) < 2:  # every timed step is marked warm-up
        return None
    left_out = len(warm)
    step = statistics.fmean(float(r.step_seconds or 0.0) for r in steady)
    tokens = statistics.fmean(float(r.step_trained_tokens or 0.0) for r in steady)
    warm_extra = max(0.0, sum(float(r.step_seconds or 0.0) for r in warm) - left_out * step)
    return _steady(step, tokens, warm_extra, len(steady), left_out)


def _steady(
    step: float, tokens: float, warm_extra: float, n: int, left_out: int
) -> SteadyRate | None:
    if step <= 0 or tokens <= 0:
        return None
    detail = (
        f"{tokens:,.0f} trained tokens per step / {step:.3g} s per step (mean of {n} steps "
        f"after {left_out} warm-up steps: recurring stalls and pauses included)"
    )
    return SteadyRate(tokens / step, warm_extra, detail)


def device_label(dev: Any) -> str:
    """A recorded device as a person reads it (a DeviceInfo dict, or a string)."""
    if isinstance(dev, dict):  # a pitstop.probe.DeviceInfo as a dict
        name = str(dev.get("name") or "")
        if dev.get("type") == "cpu":
            return f"cpu ({name})" if name else "cpu"
        return name or str(dev.get("type") or "unknown")
    return str(dev or "unknown")
