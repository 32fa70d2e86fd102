"""`pitstop export RUN --merge`: a LoRA run's adapter merged into a plain HF model.

Refused before anything loads, each with the fix: a run still training (its lock is
held), a run directory without final/ (it stopped or is partial: resume it, or export a
checkpoint), a full fine-tune (nothing to merge), an explicit --output that exists and is
not empty (never replaced: it may be another model). The run's lock is held while
exporting from a run directory, so a `train --resume` cannot start under the export.
SIGINT and SIGTERM stop the export with its partial directory removed; after a SIGKILL
the next export removes it (train/export.py: partial_dir).
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import Any

from pitstop.commands.paths import require_outputs
from pitstop.core import run_record, runlock
from pitstop.core.errors import ConfigError, PitstopError
from pitstop.core.stopping import stop_on_signals


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `export` subcommand to an argparse subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "export", allow_abbrev=False, help="a LoRA run's adapter merged into a plain HF model"
    )
    p.add_argument("run", help="run directory (its final/ adapter) or an adapter directory")
    p.add_argument("--merge", action="store_true", help="merge the LoRA adapter into its base")
    p.add_argument("--output", help="where to write (default: RUN/merged)")
    p.add_argument(
        "--dtype",
        choices=("auto", "bf16", "fp16", "fp32"),
        default="auto",
        help="dtype of the merged weights (default auto: the base model's)",
    )
    p.set_defaults(func=run)
    return p


def _is_run_dir(path: Path) -> bool:
    return any((path / m).exists() for m in (*run_record.RUN_MARKERS, runlock.LOCK_NAME))


def check_source(path: Path) -> None:
    """ConfigError for a run that cannot be exported now (see the module docstring)."""
    if not path.exists():
        raise ConfigError(f"{path} does not exist; give the --output directory of a LoRA run")
    if not path.is_dir():
        raise ConfigError(f"{path} is a file; give a run directory or an adapter directory")
    if not _is_run_dir(path):
        return  # an adapter directory, or nothing pitstop knows: train/export.py says which
    if _full_fine_tune(path):
        raise ConfigError(
            f"{path} holds a full fine-tuned model, not a LoRA adapter: there is nothing to "
            f"merge; {_full_model_place(path)}"
        )
    who = runlock.holder(path)
    if who is not None:
        raise ConfigError(
            f"{path} is still training ({who}): its final/ is written only when the run "
            "ends. Export after it finishes, or stop it (SIGTERM saves a checkpoint) and "
            f"export that checkpoint: pitstop export {path}/checkpoints/step-N --merge "
            "--output DIR"
        )
    if (path / run_record.FINAL).is_dir():
        return
    from pitstop.train.checkpoint import complete_checkpoints  # imports torch

    ckpts = complete_checkpoints(path / run_record.CHECKPOINTS)
    status = _status(path)
    hint = (
        f"resume it (pitstop train --config {path / run_record.CONFIG} --resume) or export "
        f"its newest complete checkpoint: pitstop export {ckpts[-1][1]} --merge --output "
        f"{path / run_record.MERGED}"
        if ckpts
        else "it has no complete checkpoint either: train it again"
    )
    raise ConfigError(
        f"{path} has no final/ (the run {status}), so there is no finished adapter to merge; {hint}"
    )


def _full_fine_tune(path: Path) -> bool:
    """Whether the run's config.yaml sets no LoRA rank. A config that cannot be read is not
    taken for one: the export then says what it finds, as before."""
    from pitstop.core.config import load_yaml

    try:
        rank = load_yaml(path / run_record.CONFIG).get("lora_r")
    except PitstopError:
        return False
    return not (isinstance(rank, int) and rank > 0)


def _full_model_place(path: Path) -> str:
    """Where a full fine-tune's plain model is, or will be."""
    if (path / run_record.FINAL).is_dir():
        return "its final/ already is a plain Hugging Face model directory"
    who = runlock.holder(path)
    if who is not None:
        return f"it is still training ({who}); its final/ will be a plain model directory"
    return (
        f"it has no final/ yet (the run {_status(path)}): resume it to get one (pitstop train "
        f"--config {path / run_record.CONFIG} --resume)"
    )


def _status(path: Path) -> str:
    import json

    try:
        s = json.loads((path / run_record.SUMMARY).read_text(encoding="utf-8"))["status"]
    except (OSError, ValueError, KeyError, TypeError):
        return "did not finish: no readable summary.json"
    return "completed without a final model" if s == "completed" else f"ended {s}"


def check_dest(output: str | None) -> None:
    """An explicit --output that exists and holds anything is never replaced."""
    if output is None:
        return  # RUN/merged: pitstop's own place, replaced by a new export
    dest = Path(output)
    if dest.is_dir() and any(dest.iterdir()):
        raise ConfigError(
            f"--output {dest} exists and is not empty; pitstop export does not replace a "
            "directory it may not have written. Give a new directory, or remove this one "
            "first"
        )


def run(args: argparse.Namespace) -> int:
    if not args.merge:
        raise ConfigError(
            "pitstop export writes a merged model: pass --merge (a full fine-tune's final/ "
            "already is a plain Hugging Face model directory)"
        )
    require_outputs(dirs={"--output": args.output})
    src = Path(args.run)
    check_source(src)
    check_dest(args.output)
    # Held while exporting: a `train --resume` of this run cannot start under the export.
    lock = runlock.acquire(src) if _is_run_dir(src) else contextlib.nullcontext()
    # SIGTERM too ends through the cleanup that removes the partial copy (Python's default
    # ended the process around it).
    stopping = stop_on_signals(
        "the export", "nothing was written (the partial copy was removed); run it again"
    )
    with lock, stopping:
        from pitstop.train.export import merge_adapter  # imports torch and transformers

        dest = merge_adapter(src, Path(args.output) if args.output else None, args.dtype)
    print(f"merged model: {dest}")
    return 0
