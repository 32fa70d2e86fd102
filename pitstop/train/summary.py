"""The run's outputs others read: summary.json and metrics.jsonl, written safely.

`trainer_summary` builds the trainer's `RunSummary` (pitstop.core.run_record), which
`run_record.write_summary` writes: the one summary writer every run uses.

summary.json is replaced atomically (temporary file + os.replace). metrics.jsonl
grows by whole lines, each batch of lines in one write() on an O_APPEND file, so a
reader sees complete lines (a crash can at worst cut the last one, which readers
skip); when a resumed run drops the lines a dead process wrote after its last
checkpoint, the file is rewritten to a temporary file and replaced atomically.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from pitstop.core.atomic import write_text_atomic
from pitstop.core.run_record import FINAL, ChoiceRecord, PlannedEfficiency, RunSummary
from pitstop.measure import flops as flops_mod
from pitstop.measure.machine import CpuSnapshot, machine_load, shared_by_others
from pitstop.measure.memory import peak_memory
from pitstop.probe import Choice, DeviceInfo
from pitstop.train.state import RunState


def _clean(v: Any) -> Any:
    """JSON has no NaN/Inf: a non-finite number is written as null."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def jsonl_text(records: list[dict[str, Any]]) -> str:
    """metrics.jsonl lines for `records` (non-finite numbers as null)."""
    return "".join(json.dumps({k: _clean(v) for k, v in r.items()}) + "\n" for r in records)


def append_lines(path: Path, records: list[dict[str, Any]]) -> None:
    if not records:
        return
    text = jsonl_text(records)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, text.encode("utf-8"))
    finally:
        os.close(fd)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every complete line of a metrics.jsonl (a torn last line is skipped)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def truncate_metrics(path: Path, last_step: int) -> None:
    """Keep only lines of steps <= `last_step` (a resumed run rewrites what came after)."""
    if not path.is_file():
        return
    # Lines a damaged file holds that are not step records (no integer "step") are dropped
    # too: the resumed run rewrites them, and `pitstop report` would refuse them.
    kept = [
        r
        for r in read_metrics(path)
        if isinstance(r, dict) and _is_int(r.get("step")) and r["step"] <= last_step
    ]
    write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))


def trainer_summary(
    status: str,
    *,
    state: RunState,
    total_steps: int,
    world_size: int,
    device: DeviceInfo,
    device_type: str,
    choices: dict[str, Choice],
    measured: ChoiceRecord | None,
    planned_efficiency: PlannedEfficiency | None,
    flops_per_token: float | None,
    peak_flops: float | None,
    peak_source: str | None,
    checkpoints: Any,
    t_process: float,
    cpu_start: CpuSnapshot | None,
    out: Path,
    config: dict[str, Any],
    resumed_from: str | None,
    final_saved: bool = True,
    faults_per_step: float | None = None,
) -> RunSummary:
    """The `pitstop train` run's summary.json so far. `checkpoints` is the run's checkpoint
    writer (its best checkpoint, write seconds and host buffer); `t_process` the
    time.time() this process started (wall_seconds adds the runs before a resume); `cpu_start`
    the CPU times other processes' share of the machine is measured from; `final_saved` False:
    a measurement run that keeps no final model (`Trainer(save_final=False)`);
    `faults_per_step` the process's minor page faults per step after its first."""
    import torch  # the trainer has it loaded; torch-free readers never call this

    ts = state.train_seconds
    mfu = flops_mod.mfu(state.padded_tokens / ts, flops_per_token, peak_flops) if ts > 0 else None
    eff = state.seen_tokens / state.padded_tokens if state.padded_tokens else None  # measured
    ev = state.last_eval
    return RunSummary(
        status=status,
        source="pitstop",
        optimizer_steps=state.step,
        total_steps=total_steps,
        epochs=state.epoch_float,
        trained_tokens=state.trained_tokens,
        seen_tokens=state.seen_tokens,
        padded_tokens=state.padded_tokens,
        train_seconds=ts,
        wall_seconds=state.wall_before + time.time() - t_process,
        tokens_per_second=state.trained_tokens / ts if ts > 0 else None,
        seen_tokens_per_second=state.seen_tokens / ts if ts > 0 else None,
        mfu=mfu,
        flops_per_token=flops_per_token,
        peak_flops=peak_flops,
        peak_flops_source=peak_source,
        peak_memory_bytes=peak_memory(device_type),
        final_loss=state.last_loss,
        final_loss_step=state.last_loss_step,
        eval_loss=ev["eval_loss"] if ev else None,
        eval_ppl=ev["eval_ppl"] if ev else None,
        eval=dict(ev) if ev else None,
        best_checkpoint=checkpoints.best,
        world_size=world_size,
        time_breakdown=dict(state.phase_totals),
        checkpoint_pause_seconds=state.ckpt_pause,
        host_page_faults_per_step=faults_per_step,
        checkpoint_write_seconds=checkpoints.write_seconds,
        checkpoint_host_buffer_bytes=checkpoints.staging.nbytes,
        skipped_steps=state.skipped_steps,
        packing_efficiency=eff,
        padding_waste=1 - eff if eff is not None else None,
        planned_efficiency=planned_efficiency,  # epoch 0 plan, before running
        device={**device.to_dict(), "torch": torch.__version__},
        machine=machine_load(since=cpu_start),  # the load its figures were measured under
        choices={k: c.to_dict() for k, c in choices.items()},
        measured_choices=measured.to_dict() if measured else None,
        resumed_from=str(resumed_from) if resumed_from else None,
        final_model=str(out / FINAL) if status == "completed" and final_saved else None,
        config=config,
    )


def result_line(s: RunSummary) -> str:
    """The one line a finished run prints."""
    mfu = f", MFU {100 * s.mfu:.1f}%" if s.mfu is not None else ""
    loss = f"{s.final_loss:.4f}" if s.final_loss is not None else "n/a"
    at = s.final_loss_step
    if at is not None and at != s.optimizer_steps:  # the last steps were skipped
        loss += f" (step {at}, the last finite one)"
    shared = shared_by_others(s.machine)  # the rate was measured beside other work
    shared = f" while {shared}, so slower than this machine alone" if shared else ""
    return (
        f"pitstop: {s.optimizer_steps} steps, {s.trained_tokens or 0:,} trained tokens in "
        f"{s.train_seconds or 0:.1f} s ({(s.tokens_per_second or 0):,.0f} tokens/s{mfu}"
        f"{shared}); final loss {loss}; "
        + (f"model in {s.final_model}" if s.final_model else "no final model kept")
    )
