"""The profile dict: what `pitstop profile` and `pitstop.hf.PitstopCallback` write as JSON.

One schema for both sources, so `pitstop doctor --profile` and the verdict read
either. Keys (units in the names where a user reads them)::

    schema             "pitstop.profile/1"
    source             "pitstop" | "hf" | "script" (a plain loop under pitstop.watch /
                       `pitstop profile -- COMMAND`: its config is what the hooks observed)
    steps              K, optimizer steps measured (after the warm-up)
    warmup             W, optimizer steps run first and left out of every number below
    step_seconds       [K floats], wall time of each measured step
    phases             {phase: seconds summed over the K steps}, every name in
                       pitstop.measure.timeline.PHASES; "other" is the unexplained rest,
                       so the phases add up to sum(step_seconds)
    events             {"checkpoints": n, "evals": n, "logs": n} within the K steps (optional)
    tokens_per_second  trained (loss-carrying) tokens / training seconds: sum(step_seconds)
                       less the evaluation phase (an evaluation trains nothing)
    tokens_per_step    trained tokens per optimizer step, mean (optional)
    mfu                model FLOPs utilisation, or null when the device peak is unknown
    peak_memory_bytes  peak accelerator memory allocated (CUDA) or peak RSS (CPU)
    device             pitstop.probe.DeviceInfo.to_dict()
    choices            {name: {"value", "reason"}} (pitstop) or {} (hf)
    config             the RunConfig dict (pitstop) or TrainingArguments.to_dict() (hf)
    utilisation        pitstop.measure.sampler.Sampler.summary() (optional)
    notes              [str], anything the producer wants the doctor to see (optional)
    seen_tokens        non-padding positions of the K steps (optional; the padding share is
                       1 - seen_tokens / padded_tokens)
    padded_tokens      positions computed in the K steps, padding included (optional)
    flops_per_token    the FLOPs per position MFU was computed with (optional)
    program            what ran the loop (optional): "trainer" (a Hugging Face / TRL Trainer),
                       "lightning", "accelerate" or "loop" (pitstop.anyloop.program)
    model_shapes       {"hidden_size", "intermediate_size", "vocab_size"} of the trained model,
                       read off its layers (optional): the shapes a CPU's fp32 / bf16 speed is
                       measured at for the precision finding
    host_page_faults_per_step  minor page faults of the process per step, on a CPU
                       (optional; the median measured step, or for pitstop's own profile
                       summary.json's mean after step 1): memory the kernel mapped in on first
                       touch, mostly a step's tensors handed back to the OS and allocated again
    page_fault_seconds what one minor page fault cost on this machine, measured when the
                       profile was written (optional; pitstop.core.host_malloc)
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pitstop.core.errors import DataError
from pitstop.core.run_record import HF_PROFILE, PROFILE, check_fields
from pitstop.measure.timeline import PHASES

SCHEMA = "pitstop.profile/1"
REQUIRED = ("steps", "step_seconds", "phases")


def make_profile(
    step_phases: Sequence[dict[str, float]],
    step_seconds: Sequence[float],
    *,
    warmup: int,
    source: str,
    trained_tokens: float | None = None,
    mfu: float | None = None,
    peak_memory_bytes: int = 0,
    device: dict[str, Any] | None = None,
    choices: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
    events: dict[str, int] | None = None,
    utilisation: dict[str, Any] | None = None,
    notes: Sequence[str] = (),
) -> dict[str, Any]:
    """Build a profile dict from per-step phase seconds of the K measured steps.

    `step_phases[i]` is one step's {phase: seconds} (e.g. `StepRecord.resolve()`), and
    `step_seconds[i]` its wall time; `trained_tokens` counts the K steps only.
    """
    phases = dict.fromkeys(PHASES, 0.0)
    for rec in step_phases:
        for name, sec in rec.items():
            phases[name] = phases.get(name, 0.0) + float(sec)
    # Rounded to the microsecond before anything is derived from them, so a reader who
    # recomputes tokens/s from the recorded seconds gets the recorded figure.
    phases = {n: round(v, 6) for n, v in phases.items()}
    seconds = [round(float(s), 6) for s in step_seconds]
    # Throughput is training's: an evaluation's seconds train nothing (they are its phase).
    training = sum(seconds) - phases.get("eval", 0.0)
    k = len(seconds)
    return {
        "schema": SCHEMA,
        "source": source,
        "steps": k,
        "warmup": int(warmup),
        "step_seconds": seconds,
        "phases": phases,
        "events": dict(events or {}),
        "tokens_per_second": (float(trained_tokens) / training)
        if trained_tokens and training > 0
        else 0.0,
        "tokens_per_step": (float(trained_tokens) / k) if trained_tokens and k else None,
        "mfu": mfu,
        "peak_memory_bytes": int(peak_memory_bytes),
        "device": dict(device or {}),
        "choices": dict(choices or {}),
        "config": dict(config or {}),
        "utilisation": dict(utilisation or {}),
        "notes": list(notes),
    }


# The kind of each field a reader relies on (pitstop.core.run_record.check_fields names the wrong ones).
FIELD_KINDS = {
    "schema": "str", "source": "str", "steps": "int", "warmup": "int", "step_seconds": "num_list",
    "phases": "num_map", "events": "num_map", "tokens_per_second": "num", "tokens_per_step": "num",
    "mfu": "num", "peak_memory_bytes": "num", "device": "dict_or_str", "choices": "dict",
    "config": "dict", "utilisation": "dict", "notes": "list", "machine": "dict",
    "seen_tokens": "num", "padded_tokens": "num", "flops_per_token": "num", "program": "str",
    "model_shapes": "dict", "host_page_faults_per_step": "num", "page_fault_seconds": "num",
}  # fmt: skip


def _value_problems(profile: Mapping[str, object], where: str) -> list[str]:
    """Values of the right kind that no measurement gives: another schema, a negative or
    non-finite second (a hand-edited file once priced a run at -226,466 s)."""
    out = []
    schema = profile.get("schema")
    if isinstance(schema, str) and schema != SCHEMA:
        out.append(f"{where}: schema {schema!r}; this pitstop reads {SCHEMA!r}")
    seconds = profile.get("step_seconds")
    if isinstance(seconds, list) and not all(_seconds_ok(x) for x in seconds):
        out.append(f"{where}: step_seconds holds a negative or non-finite time")
    phases = profile.get("phases")
    if isinstance(phases, dict):
        bad = sorted(str(k) for k, v in phases.items() if not _seconds_ok(v))
        if bad:
            out.append(f"{where}: phases {', '.join(bad)}: a negative or non-finite time")
    return out


def _seconds_ok(value: Any) -> bool:
    """A time a clock could give: a finite number, not below 0 (other kinds are
    check_fields' to name)."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return not number or (math.isfinite(value) and value >= 0)


def check_profile(profile: Any, where: str = "profile") -> dict[str, Any]:
    """Validate the shape of a profile (every field the verdict and the doctor read); return it."""
    if not isinstance(profile, dict):
        raise DataError(f"{where}: a profile must be a JSON object, got {type(profile).__name__}")
    problems = [f"{where}: missing key {k!r}" for k in REQUIRED if k not in profile]
    try:
        check_fields(profile, FIELD_KINDS, where)
    except DataError as e:
        problems += e.problems
    problems += _value_problems(profile, where)
    if problems:
        raise DataError(
            [*problems, "write profiles with `pitstop profile` or pitstop.hf.PitstopCallback"],
            header=f"{where} is not a pitstop profile:",
        )
    return profile


# The profile a run directory holds: PitstopCallback's and a profiled command's, or one
# `pitstop profile --output DIR/profile.json` wrote there.
RUN_DIR_PROFILES = (HF_PROFILE, PROFILE)


def load_profile(path: str | Path) -> dict[str, Any]:
    """Read and check a profile.json, or the profile in a run directory (DataError with the
    reason when it is not one)."""
    p = Path(path)
    if p.is_dir():
        held = [p / n for n in RUN_DIR_PROFILES if (p / n).is_file()]
        if not held:
            raise DataError(
                f"{p} is a directory without a profile ({' or '.join(RUN_DIR_PROFILES)}); give "
                "the run directory of `pitstop profile -- COMMAND`, a Trainer run with "
                "PitstopCallback, or a profile.json from `pitstop profile`"
            )
        p = held[0]
    if not p.is_file():
        raise DataError(f"profile {p} does not exist; write one with `pitstop profile`")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{p}: not valid JSON ({e})") from None
    return check_profile(data, str(p))
