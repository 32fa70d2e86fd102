"""Where the run's per-step metrics go: metrics.jsonl, TensorBoard, wandb, the progress bar.

`RunLog` is the one object the loop hands finished metrics lines to (rank 0 only; the
other ranks get one whose sinks are the no-op stand-ins). TensorBoard and wandb are
optional: a run without them gets `NullWriter` / `NullRun` (docs/style.md, 6: the loop never
asks whether a sink is on), and a one-line notice when the user asked for one that is
not installed.
"""

from __future__ import annotations

import math
import os
import secrets
import sys
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from pitstop.core import log, run_record
from pitstop.core.atomic import write_text_atomic
from pitstop.core.config import RunConfig
from pitstop.measure.timeline import PHASES
from pitstop.probe import Choice
from pitstop.train.summary import append_lines

# The scalars TensorBoard and wandb get, from each metrics.jsonl line: train/<key>,
# eval/<key without "eval_">, and time/<phase> for every `<phase>_s` of the step timeline.
_TRAIN_SCALARS = ("loss", "lr", "grad_norm", "tokens_per_second", "step_seconds", "mfu")
_EVAL_SCALARS = ("eval_loss", "eval_ppl")
_MEMORY = "peak_memory_gib"  # on logging steps of a CUDA run: memory/peak_gib


class NullWriter:
    """Stands in for TensorBoard when it is off: the loop never asks whether it is on."""

    def add_scalar(self, *args: Any, **kwargs: Any) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class NullRun:
    """Stands in for a wandb run when wandb is off or not installed."""

    def log(self, data: dict[str, float], step: int) -> None:
        pass

    def finish(self) -> None:
        pass


def open_tensorboard(cfg: RunConfig, out: Path, enabled: bool) -> tuple[Any, str]:
    """A SummaryWriter in OUT_DIR/tensorboard, or a NullWriter and why."""
    if not enabled:
        return NullWriter(), "rank 0 writes the events"
    if "tensorboard" not in cfg.report_to:
        return NullWriter(), "not in --report-to"
    try:
        from torch.utils.tensorboard import SummaryWriter  # optional: needs `tensorboard`
    except ImportError:
        log.warning(
            "pitstop: TensorBoard logging skipped: the tensorboard package is not installed "
            "(pip install 'pitstop[tensorboard]')",
        )
        return NullWriter(), "tensorboard not installed"
    return SummaryWriter(
        log_dir=str(out / run_record.TENSORBOARD)
    ), f"events in {out / run_record.TENSORBOARD}"


def open_wandb(cfg: RunConfig, out: Path, enabled: bool) -> tuple[Any, str]:
    """A wandb run logging the same scalars as TensorBoard; WANDB_MODE/PROJECT are respected.

    wandb is optional: not installed gives a one-line notice and no logging, never an error.
    """
    if not enabled:
        return NullRun(), "rank 0 logs the run"
    if "wandb" not in cfg.report_to:
        return NullRun(), "not in --report-to"
    try:
        import wandb  # optional and slow to import: only when asked for
    except ImportError:
        log.warning(
            "pitstop: wandb logging skipped: the wandb package is not installed (pip install wandb)"
        )
        return NullRun(), "wandb not installed"
    run_id = wandb_run_id(out)
    try:
        run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "pitstop"),
            name=out.name,
            dir=str(out),
            config=cfg.to_dict(),
            id=run_id,
            resume="allow",
        )
    except Exception as e:  # no login, no network in online mode...: the run goes on
        log.warning(
            f"pitstop: wandb logging skipped: wandb.init failed ({type(e).__name__}: {e}); "
            "set WANDB_MODE=offline to log without a network"
        )
        return NullRun(), f"wandb.init failed: {type(e).__name__}"
    mode = os.environ.get("WANDB_MODE", "online")
    return run, f"mode {mode}, run {run_id}"


def wandb_run_id(out: Path) -> str:
    """The wandb run id of the run in `out`: the one recorded there (a resumed run continues
    the same wandb run), else a new one, recorded before wandb starts."""
    path = out / run_record.WANDB_ID
    if path.is_file():
        kept = path.read_text(encoding="utf-8").strip()
        if kept.isalnum() and 0 < len(kept) <= 64:
            return kept
    new = secrets.token_hex(4)  # wandb's own ids are 8 lowercase alphanumerics too
    out.mkdir(parents=True, exist_ok=True)  # a caller may open wandb before the run writes
    write_text_atomic(path, new + "\n")
    return new


def open_progress(total: int, initial: int) -> Any:
    """A tqdm bar on a terminal (PITSTOP_PROGRESS=1/0 forces it on/off)."""

    force = os.environ.get("PITSTOP_PROGRESS")
    disable = None if force is None else force == "0"  # None: only on a terminal
    if not log.progress_enabled():  # --quiet / --log-level warning
        disable = True
    return tqdm(
        total=total,
        initial=initial,
        unit="step",
        file=sys.stderr,
        disable=disable,
        dynamic_ncols=True,
        desc="train",
    )


def eta(step: int, total_steps: int, train_seconds: float) -> str:
    """Time left at the run's mean step time so far (a terminal's bar shows its own)."""
    if step <= 0 or train_seconds <= 0:
        return "?"
    left = round((total_steps - step) * train_seconds / step)
    h, rem = divmod(left, 3600)
    return f"{h}h{rem // 60:02d}m" if h else f"{rem // 60}m{rem % 60:02d}s"


def _scalars(line: dict[str, Any]) -> dict[str, float]:
    """A metrics line's TensorBoard/wandb scalars; skipped (None) and non-finite values left out."""
    scalars = {
        **{f"train/{k}": line[k] for k in _TRAIN_SCALARS if k in line},
        **{f"eval/{k[5:]}": line[k] for k in _EVAL_SCALARS if k in line},
        **{f"time/{p}": line[f"{p}_s"] for p in PHASES if f"{p}_s" in line},
    }
    if _MEMORY in line:
        scalars["memory/peak_gib"] = line[_MEMORY]
    return {k: v for k, v in scalars.items() if v is not None and math.isfinite(v)}


class RunLog:
    """The run's metrics sinks. Build it after the output directory exists; `close()` at the end.

    `enabled`: this process writes (rank 0). `choices` records what TensorBoard and wandb
    do, for the banner and summary.json.
    """

    def __init__(self, cfg: RunConfig, out: Path, *, enabled: bool, total_steps: int) -> None:
        self.metrics_path = out / run_record.METRICS
        self.enabled = enabled
        self.total_steps = total_steps
        self.tb, tb_note = open_tensorboard(cfg, out, enabled)
        self.wb, wb_note = open_wandb(cfg, out, enabled)
        self.choices = {"tensorboard": Choice(not isinstance(self.tb, NullWriter), tb_note)}
        if "wandb" in cfg.report_to:
            self.choices["wandb"] = Choice(not isinstance(self.wb, NullRun), wb_note)
        self.bar: Any = None

    def start_progress(self, initial_step: int) -> None:
        """The progress bar (or, off a terminal, a line per logging step) from `initial_step`."""
        if self.enabled:
            self.bar = open_progress(self.total_steps, initial_step)

    def step_done(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def stop_progress(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def append_metrics(self, lines: list[dict[str, Any]]) -> None:
        """metrics.jsonl only (a run that stops at these lines still records them)."""
        if self.enabled:
            append_lines(self.metrics_path, lines)

    def write(
        self,
        lines: list[dict[str, Any]],
        *,
        trained_tokens: int,
        train_seconds: float,
        progress: bool,
    ) -> None:
        """Finished metrics lines to every sink; `progress`: also show the newest on the bar,
        with the run's tokens/s and ETA so far (`trained_tokens` in `train_seconds`)."""
        if not self.enabled or not lines:
            return
        append_lines(self.metrics_path, lines)
        for line in lines:
            scalars = _scalars(line)
            for key, v in scalars.items():
                self.tb.add_scalar(key, v, line["step"])
            self.wb.log(scalars, step=line["step"])
        self.tb.flush()
        if progress:
            self._show(lines[-1], trained_tokens, train_seconds)

    def _show(self, last: dict[str, Any], trained_tokens: int, train_seconds: float) -> None:
        tps = trained_tokens / train_seconds if train_seconds > 0 else 0.0
        bar = self.bar
        if bar is None:
            return
        if not bar.disable:
            bar.set_postfix(
                loss=f"{last['loss']:.4f}" if last["loss"] is not None else "skip",
                tok_s=f"{tps:,.0f}",
                refresh=False,
            )
        else:
            loss_s = f"{last['loss']:.4f}" if last["loss"] is not None else "skipped"
            log.info(
                f"step {last['step']}/{self.total_steps}  loss {loss_s}  lr {last['lr']:.3g}  "
                f"{tps:,.0f} tokens/s  ETA {eta(last['step'], self.total_steps, train_seconds)}"
            )

    def close(self) -> None:
        self.tb.close()
        self.wb.finish()
