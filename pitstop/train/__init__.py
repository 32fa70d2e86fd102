"""The training run: `run(cfg)` trains, writes OUT_DIR and returns the summary.

OUT_DIR receives summary.json, metrics.jsonl (one line per optimizer step),
TensorBoard events (when installed and asked for), checkpoints/step-N/ and final/
(loadable with AutoModelForCausalLM.from_pretrained, or a PEFT adapter for LoRA),
and report.html (`pitstop report` of the run) at the end.
See `pitstop.train.trainer` for the loop and the metrics.jsonl fields, and
`pitstop.train.checkpoint` for the checkpoint layout and its guarantees.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pitstop.config import RunConfig

__all__ = ["RunInterrupted", "Trainer", "TrainingDiverged", "run"]


def run(cfg: RunConfig, **kwargs: Any) -> dict[str, Any]:
    """Train as `cfg` says and return the summary (also written to OUT_DIR/summary.json).

    Raises ConfigError (exit 2) before writing anything when the request is impossible,
    RunInterrupted (exit 130/143) after saving a checkpoint on SIGINT/SIGTERM,
    TrainingDiverged after cfg.max_bad_steps non-finite steps in a row, and
    CheckpointError when a checkpoint cannot be written. Keyword arguments go to
    `Trainer` (device=..., loader=..., rank=..., world_size=...).

    Several processes: under torchrun (WORLD_SIZE set) every process calls this and
    trains its share; with `cfg.nproc > 1` outside torchrun, this process relaunches
    the run as `cfg.nproc` processes (`pitstop.train.distributed.launch`) and returns
    rank 0's summary. Multi-node: see `pitstop.train.distributed`.
    """
    from pitstop.train import distributed
    from pitstop.train.trainer import Trainer

    if cfg.nproc > 1 and distributed.env_world() == 1 and not kwargs:
        return distributed.launch(cfg)
    trainer = Trainer(cfg, **kwargs)
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 alone writes
        _write_report(cfg)
    return summary


def _write_report(cfg: RunConfig) -> None:
    """OUT_DIR/report.html after a completed run; the run itself is done, so a report
    that cannot be written is a warning, never a failed run."""
    import sys

    from pitstop.errors import PitstopError
    from pitstop.report.html import write_report

    try:
        path = write_report(cfg.output, Path(cfg.output) / "report.html")
    except (OSError, PitstopError) as e:
        print(
            f"pitstop: report.html not written ({e}); run `pitstop report {cfg.output}`",
            file=sys.stderr,
        )
        return
    print(f"pitstop: report written to {path}", file=sys.stderr)


def __getattr__(name: str) -> Any:
    if name in ("Trainer", "RunInterrupted", "TrainingDiverged"):
        from pitstop.train import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'pitstop.train' has no attribute {name!r}")
