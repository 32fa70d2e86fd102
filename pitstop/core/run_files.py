"""Whose files an OUT_DIR without a run holds: pitstop's, or the user's.

`pitstop train` writes a fixed set of top-level names (`TRAIN_WRITES`). A run stopped
before its first checkpoint leaves some of them and no run marker (`run_record.RUN_MARKERS`),
and running again there (with or without --resume) must keep working; a user's own file
of the same name must not be replaced without --overwrite (docs/guarantees.md, "nothing
lost"). So each name is judged by its content: pitstop's own files have a shape no
hand-written file has by accident (a YAML dump with pitstop's flags, step records with
pitstop's fields, a validated choices record). An empty file holds nothing to lose.

Reads only, and only regular files: a FIFO would block a read (the lock's own checks
name a FIFO at `.lock`, so that one is left to them).
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path

import yaml

from pitstop.core import run_record
from pitstop.core.errors import DataError
from pitstop.core.runlock import LOCK_NAME

# Every line pitstop train writes to metrics.jsonl has these keys (train/pending.py `_line`).
STEP_KEYS = frozenset({"step", "lr", "loss", "grad_norm", "skipped", "step_seconds"})
# pitstop's config.yaml is `RunConfig.saved_yaml()`: every field, these among them, and the
# start-up flags written as false (the file describes the run, not one start of it).
CONFIG_KEYS = frozenset({"model", "data", "output", "resume", "overwrite"})
# What the lock holds: "pid host" (core/runlock.py).
LOCK_LINE = re.compile(r"\d+ \S+\n?")
TFEVENTS = "events.out.tfevents."


def _text(path: Path) -> str | None:
    """The file's UTF-8 text, or None when it is not a readable regular text file."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return None
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def own_config(path: Path) -> bool:
    """Whether `path` is a config.yaml pitstop train wrote: a plain YAML dump (comments or
    any other formatting would not survive `yaml.safe_dump`) of pitstop's fields."""
    text = _text(path)
    if text is None:
        return False
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return False
    return (
        isinstance(data, dict)
        and data.keys() >= CONFIG_KEYS
        and data["resume"] is False
        and data["overwrite"] is False
        and yaml.safe_dump(data, sort_keys=False) == text
    )


def own_metrics(path: Path) -> bool:
    """Whether every line of `path` is a step record pitstop train wrote; a last line cut
    off by a kill (no newline, not JSON) is one too."""
    text = _text(path)
    if text is None:
        return False
    lines = text.splitlines()
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            if i == len(lines) - 1 and not text.endswith("\n"):
                continue  # the half-written last line of a killed run
            return False
        ok = isinstance(rec, dict) and rec.keys() >= STEP_KEYS and type(rec["step"]) is int
        if not ok:
            return False
    return True


def own_choices(path: Path) -> bool:
    """Whether `path` is a choices record (the shape `run_record.read_choices` accepts)."""
    if _text(path) is None:
        return False
    try:
        run_record.read_choices(path)
    except DataError:
        return False
    return True


def own_wandb_id(path: Path) -> bool:
    """An id as train/run_log.py `wandb_run_id` writes and reads back."""
    text = _text(path)
    kept = (text or "").strip()
    return text is not None and kept.isalnum() and len(kept) <= 64


def own_lock(path: Path) -> bool:
    """A lock file: "pid host", or anything but a regular file (runlock refuses that)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return True
    except OSError:
        return True
    text = _text(path)
    return text is not None and LOCK_LINE.fullmatch(text) is not None


def own_tensorboard(path: Path) -> bool:
    """A folder holding only TensorBoard event files (what `--report-to tensorboard` writes)."""
    if not path.is_dir() or path.is_symlink():
        return False
    return all(p.is_dir() or p.name.startswith(TFEVENTS) for p in path.rglob("*"))


def _never(path: Path) -> bool:
    """Written only at the end of a run, beside the markers: without them, not pitstop's."""
    return False


# The top-level names `pitstop train` writes besides the run markers, each with the test
# that tells pitstop's file from a user's (docs/run-directory.md lists them).
TRAIN_WRITES: dict[str, Callable[[Path], bool]] = {
    run_record.CONFIG: own_config,
    run_record.METRICS: own_metrics,
    run_record.CHOICES: own_choices,
    run_record.WANDB_ID: own_wandb_id,
    run_record.REPORT: _never,  # commands/train.py, after a completed run
    run_record.MERGED: _never,  # --merge-lora, after final/
    run_record.TENSORBOARD: own_tensorboard,
    LOCK_NAME: own_lock,
}


def _empty(path: Path) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if stat.S_ISDIR(st.st_mode):
        return not any(path.iterdir())
    return stat.S_ISREG(st.st_mode) and st.st_size == 0


def foreign_files(out: Path) -> list[str]:
    """The names in `out` that `pitstop train` would write but that pitstop did not write
    (judged by content; an empty file or folder holds nothing to lose). Reads only."""
    found = []
    for name, ours in TRAIN_WRITES.items():
        path = out / name
        if os.path.lexists(path) and not _empty(path) and not ours(path):
            found.append(name)
    return found
