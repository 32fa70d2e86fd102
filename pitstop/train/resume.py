"""What `--resume` continues from, and whether it may continue at all.

Three rules, each checked before anything in OUT_DIR is changed:

* Which checkpoint: the newest complete one. A newer step-N directory that is damaged
  is named with its fault, and left as it is. With step directories present and none
  complete, the resume is refused with each one's fault; only a run directory without
  any checkpoint (and no final/) starts again from step 0.
* The same run: a checkpoint records the run's identity (`identity()`): the token
  store's content key and every setting that changes the math. A resume that differs
  is refused with the list, unless --resume-with-changes is given.
* The record: when the configuration differs in any way, the previous config.yaml is
  kept beside the new one (`keep_previous_config`), never overwritten silently.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TypedDict

from pitstop.core import log
from pitstop.core.config import RunConfig
from pitstop.core.errors import ConfigError
from pitstop.train import checkpoint

# Settings whose change makes the resumed run a different run (data order, model, the
# optimizer's trajectory or the schedule). Layout settings (batching, micro-batch
# size, workers) only arrange the same steps and are free to change.
MATH_SETTINGS = (
    *("model", "max_seq_len", "tokens_per_step"),  # what is trained on, in what shape
    *("lr", "schedule", "min_lr_ratio", "warmup_steps", "weight_decay", "max_grad_norm"),
    *("max_steps", "epochs", "total_steps"),  # the run's length (the schedule stretches)
    *("seed", "lora_r", "lora_alpha"),
)


class RunIdentity(TypedDict):
    """What makes a run this run (MATH_SETTINGS and its data), as trainer_state.json's
    `identity` holds it: resolved values, not defaults."""

    model: str | None  # the model directory, resolved
    max_seq_len: int
    tokens_per_step: int
    lr: float
    schedule: str
    min_lr_ratio: float
    warmup_steps: int
    weight_decay: float
    max_grad_norm: float
    max_steps: int | None
    epochs: float | None
    total_steps: int
    seed: int
    lora_r: int | None
    lora_alpha: float | None
    data: str | None  # the token store's cache key


def identity(
    cfg: RunConfig,
    *,
    data_key: str | None,
    max_seq_len: int,
    tokens_per_step: int,
    total_steps: int,
    warmup_steps: int,
) -> RunIdentity:
    """The run's identity as a checkpoint records it (resolved values, not defaults)."""
    fields = cfg.to_dict()
    math = {k: fields.get(k) for k in MATH_SETTINGS}
    out = RunIdentity(**math, data=data_key)  # type: ignore[typeddict-item]
    out.update(
        model=str(Path(cfg.model).resolve()) if cfg.model else None,
        max_seq_len=max_seq_len,
        tokens_per_step=tokens_per_step,
        total_steps=total_steps,
        warmup_steps=warmup_steps,
    )
    return out


def choose_checkpoint(out: Path, *, announce: bool = True) -> Path | None:
    """The checkpoint to resume from; None: nothing to continue, start from step 0.

    Raises CheckpointError, listing each checkpoint's fault, when step directories
    exist but none is complete (or only final/ is left): nothing is touched.
    """
    root = out / "checkpoints"
    damaged: list[str] = []
    for _, path in reversed(checkpoint.step_dirs(root)):
        why = checkpoint.incomplete_reason(path)
        if why is None:
            if damaged and announce:
                log.warning(
                    f"pitstop: warning: resuming from the older checkpoint {path}: the newer "
                    f"{'; '.join(damaged)} (left as it is)"
                )
            return path
        damaged.append(f"{path} is damaged: {why}")
    if damaged:
        raise checkpoint.CheckpointError(
            damaged,
            header=f"cannot resume {out}: no checkpoint in it is complete, so nothing was "
            "changed. Restore the missing files, or start again with --overwrite:",
        )
    if (out / "final").exists():
        raise checkpoint.CheckpointError(
            f"cannot resume {out}: it holds a final model but no checkpoint to continue "
            "from; nothing was changed. Start again with --overwrite, or choose another --output"
        )
    if announce:
        log.info(f"pitstop: no checkpoint in {root} yet; starting from step 0")
    return None


def check_same_run(
    saved: RunIdentity | None, now: RunIdentity, *, allow: bool, path: Path
) -> list[str]:
    """The math settings that differ from checkpoint `path`'s; ConfigError unless `allow`."""
    if not saved:  # a checkpoint from before identities were recorded: the loader checks
        return []
    changed = [
        f"{k}: {saved[k]!r} then, {v!r} now" for k, v in now.items() if k in saved and saved[k] != v
    ]
    if changed and not allow:
        raise ConfigError(
            changed,
            header=f"cannot resume from {path}: these settings differ from the run's and change "
            "what it learns, so it would not be the same run. Restore them (the run's settings "
            "are in its config.yaml), or add --resume-with-changes to continue with the new "
            "ones (the old config.yaml is kept beside the new one):",
        )
    return changed


def keep_previous_config(out: Path, new_yaml: str, step: int) -> Path | None:
    """Move a differing config.yaml aside (config.before-step-N.yaml); returns where."""
    old = out / "config.yaml"
    try:
        if not old.is_file() or old.read_text(encoding="utf-8") == new_yaml:
            return None
    except (OSError, UnicodeDecodeError):
        return None
    dest = out / f"config.before-step-{step}.yaml"
    n = 1
    while dest.exists():
        n += 1
        dest = out / f"config.before-step-{step}.{n}.yaml"
    os.replace(old, dest)
    return dest
