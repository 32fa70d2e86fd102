"""The run directory before the first step: cleared, created, resumed from, recorded.

`prepare_output` runs on every rank, in this order: --overwrite clears what a pitstop
run wrote (rank 0); stale partial checkpoints are removed; with --resume, the newest
complete checkpoint is chosen (rank 0, then broadcast: every rank reads the same one),
checked against this run's identity (train/resume.py) and restored; metrics.jsonl is
cut back to the restored step; config.yaml and the measured layout (choices.json,
before step 1, so a --resume reads it back) are written. The caller holds the run's
lock (pitstop/core/runlock.py).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from pitstop.batching.choices import write_run_choices
from pitstop.core import log, run_record
from pitstop.core.atomic import write_text_atomic
from pitstop.train import checkpoint, distributed, model_io, resume
from pitstop.train.build import Run
from pitstop.train.state import RunState
from pitstop.train.summary import truncate_metrics


@dataclass(frozen=True)
class Restored:
    state: RunState
    path: Path


def clear_run(out: Path) -> None:
    """--overwrite: remove only what a pitstop run writes (never the user's other files)."""
    for name in run_record.RUN_FILES:
        (out / name).unlink(missing_ok=True)
    for name in run_record.RUN_DIRS:
        if (out / name).exists():
            shutil.rmtree(out / name)


def identity(run: Run, total_steps: int) -> resume.RunIdentity:
    """What a checkpoint records of its run, and --resume checks (train/resume.py)."""
    return resume.identity(
        run.cfg,
        data_key=run.data_key,
        max_seq_len=run.geometry.max_seq_len,
        tokens_per_step=run.geometry.tokens_per_step,
        total_steps=total_steps,
        warmup_steps=run.warmup,
    )


def prepare_output(run: Run, *, total_steps: int) -> Restored | None:
    """Set up OUT_DIR (see the module docstring); the restored state on --resume."""
    out, cfg, is_main = run.out, run.cfg, run.env.rank == 0
    if cfg.overwrite and is_main:
        clear_run(out)
    out.mkdir(parents=True, exist_ok=True)
    if is_main:
        checkpoint.remove_debris(out / run_record.CHECKPOINTS)
    # Refuses (touching nothing) when checkpoints exist and none is complete.
    latest = resume.choose_checkpoint(out, announce=is_main) if cfg.resume else None
    # Every rank reads the same checkpoint (a shared filesystem across nodes).
    latest = distributed.broadcast_object(latest, run.env)
    restored = restore(run, latest, total_steps) if latest is not None else None
    if restored is not None:
        run.faults.reached("restored")
    step = restored.state.step if restored is not None else 0
    if is_main:
        truncate_metrics(out / run_record.METRICS, step)
        saved = cfg.saved_yaml()
        # A resumed run keeps a differing previous config.yaml beside it, checkpoint or not:
        # it may be the --config file this run was started with (never lost).
        kept = resume.keep_previous_config(out, saved, step) if cfg.resume else None
        if kept is not None:
            log.info(
                f"pitstop: the configuration differs from the run's; the previous one is "
                f"kept in {kept}"
            )
        write_text_atomic(out / run_record.CONFIG, saved)
        if run.geometry.measured is not None:  # before step 1: --resume reads it back
            write_run_choices(out, run.geometry.measured)
    run.faults.reached("measured")
    distributed.barrier(run.env)  # rank 0 has cleared/created what the others will write to
    return restored


def restore(run: Run, path: Path, total_steps: int) -> Restored:
    """Load checkpoint `path` into the run's model, optimizer, RNG and loader."""
    # FSDP: optimizer.pt is mapped, not read: rank 0 broadcasts its tensors from the page
    # cache (load_full_state), the other ranks take only the small scaler state beside them.
    st = checkpoint.read_checkpoint(path, mmap=run.fsdp)
    changed = resume.check_same_run(
        st.trainer_state.get("identity"),
        identity(run, total_steps),
        allow=run.cfg.resume_with_changes,
        path=path,
    )
    if changed and run.env.rank == 0:
        log.warning(
            "pitstop: warning: --resume-with-changes: continuing with changed settings: "
            + "; ".join(changed)
        )
    if run.fsdp:
        # Saved as full (unsharded) state by name; rank 0 reads it, each rank keeps its shard.
        optim = st.optimizer.pop("optimizer")
        distributed.load_full_state(
            run.model,
            run.optimizer,
            lambda: (model_io.read_weights(path, run.model), optim),
            run.env,
        )
        del optim
    else:
        model_io.load_weights(run.model, path)
        run.optimizer.load_state_dict(st.optimizer["optimizer"])
    if run.scaler is not None and st.optimizer.get("scaler"):
        run.scaler.load_state_dict(st.optimizer["scaler"])
    checkpoint.set_rng_state(st.rng)
    run.loader.load_state_dict(st.loader_state)
    run.writer.last_written = path
    return Restored(RunState.from_trainer_state(st.trainer_state), path)
