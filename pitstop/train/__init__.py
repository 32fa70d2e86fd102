"""The training run: `fit(cfg)` trains, writes OUT_DIR and returns the `RunSummary`.

`run(cfg)` is the same run returning the summary as summary.json's dict.

OUT_DIR receives summary.json, metrics.jsonl (one line per optimizer step),
TensorBoard events (when installed and asked for), checkpoints/step-N/ and final/
(loadable with AutoModelForCausalLM.from_pretrained, or a PEFT adapter for LoRA).
See `pitstop.train.trainer` for the loop (`Trainer`, `RunInterrupted`,
`TrainingDiverged`) and the metrics.jsonl fields, and
`pitstop.train.checkpoint` for the checkpoint layout and its guarantees.
"""

from __future__ import annotations

from typing import Any

from pitstop.core import runlock
from pitstop.core.config import RunConfig
from pitstop.core.run_record import RunSummary
from pitstop.core.stopping import stop_on_signals

__all__ = ["fit", "run"]


def run(cfg: RunConfig, **kwargs: Any) -> dict[str, Any]:
    """`fit(cfg, **kwargs)`'s summary as summary.json holds it (`RunSummary.to_json()`)."""
    return fit(cfg, **kwargs).to_json()


def fit(cfg: RunConfig, **kwargs: Any) -> RunSummary:
    """Train as `cfg` says and return the summary (also written to OUT_DIR/summary.json).

    Raises ConfigError (exit 2) before writing anything when the request is impossible,
    RunInterrupted (exit 130/143) after saving a checkpoint on SIGINT/SIGTERM,
    TrainingDiverged after cfg.max_bad_steps non-finite steps in a row, and
    CheckpointError when a checkpoint cannot be written. Keyword arguments go to
    `Trainer.from_config` (device=..., loader=..., rank=..., world_size=...).

    Several processes: under torchrun (WORLD_SIZE set) every process calls this and
    trains its share; with `cfg.nproc > 1` outside torchrun, this process relaunches
    the run as `cfg.nproc` processes (`pitstop.train.distributed.launch`) and returns
    rank 0's summary. Multi-node: see `pitstop.train.distributed`.
    """
    # Deferred: the trainer imports torch; the package's light modules (summary, banner)
    # are read by `pitstop report`/`estimate`, which must not load it.
    from pitstop.train import distributed
    from pitstop.train.trainer import Trainer

    if cfg.nproc > 1 and distributed.env_world() == 1 and not kwargs:
        with runlock.acquire(str(cfg.output)):  # the ranks it launches write under this lock
            return distributed.launch(cfg)
    # Until the loop installs its own handlers (finish the step, save, say how to resume),
    # SIGTERM ends the start-up (model load, first-step measurements) through its cleanup
    # with one line, not silently at once.
    with stop_on_signals("the run before its first step", "nothing was trained; run it again"):
        trainer = Trainer.from_config(cfg, **kwargs)
    try:
        return trainer.fit()
    finally:
        trainer.close()
