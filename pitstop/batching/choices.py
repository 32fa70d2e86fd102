"""Measured choices: made once, stored with their measurements, reused, recorded in the run.

A measured decision (today: the `auto` batching layout) costs seconds to minutes of
timing before the first step, and timing on a busy machine can rank close layouts
differently from one start to the next. So a decision is stored in the cache
(``<cache>/choices/<key>.json``) under a key of everything it depends on: the device
(name and count), the torch and transformers versions, the model's config, the token
store, and the run settings that change what is timed. A rerun of the same config
reuses it ("reused, measured 2026-11-23 16:40 UTC"); `--remeasure` measures again and
replaces it.

The run directory records the resolved choices (``choices.json``, written before the
first step), and `--resume` always takes them from there, never from the cache and
never by measuring: a run killed before its first checkpoint continues with the
layout it started with, so it ends exactly like a run never killed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pitstop.core import log, run_record
from pitstop.core.atomic import write_cache_entry
from pitstop.core.config import RunConfig
from pitstop.core.errors import DataError
from pitstop.core.run_record import ChoiceRecord, read_choices, write_choices

__all__ = [
    "NOT_MEASURED",
    "RUN_CHOICES",
    "MeasureResult",
    "MeasuredChoices",
    "choice_key",
    "load_cached",
    "read_run_choices",
    "resolve_measured",
    "save_measured",
    "write_run_choices",
]

RUN_CHOICES = run_record.CHOICES  # in the run directory
# A measurement's key for "skipped: it would not pay back on this run" (the cost model
# decided, with these numbers): such a record is not cached, so a longer run measures.
NOT_MEASURED = run_record.NOT_MEASURED
FORMAT = 1  # bump when the meaning of a stored choice changes: old entries are then ignored

# Run settings a measurement depends on: they change the micro-batches timed (the step
# plan and its split) or the cost of each (precision, kernels, memory-saving recompute).
# Not here: lr, steps, logging, checkpointing, output: they change no timing.
KEY_SETTINGS = (
    "max_seq_len", "tokens_per_step", "micro_batch_size", "tokens_per_micro_batch", "grad_accum",
    "seed", "eval_data", "precision", "attention", "compile", "gradient_checkpointing", "lora_r",
    "lora_target_modules", "load_in_4bit", "strategy", "device",
)  # fmt: skip


# What a measurement returns: (values, reasons, measurements), each keyed by the choice.
MeasureResult = tuple[dict[str, Any], dict[str, str], dict[str, Any]]

# One type for a measured choice, wherever it is kept (the cache, the run's choices.json):
# the run record's, which validates its shape when read.
MeasuredChoices = ChoiceRecord


def choice_key(
    cfg: RunConfig,
    *,
    device_name: str,
    device_count: int,
    store_manifest: Path,
    indices_count: int | None = None,
    what: str | None = None,
) -> tuple[str, dict[str, Any]]:
    """(key, the fields it hashes): everything a measured choice depends on.

    `what` names a choice other than the batching layout (e.g. "micro_batch"), so each
    is stored under its own key (the batching layout's key leaves it out)."""
    import torch
    import transformers

    model_cfg = Path(cfg.model or "") / "config.json"
    fields = {
        "format": FORMAT,
        "device": device_name,
        "device_count": device_count,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model_config_sha256": _sha256(model_cfg),
        "store_manifest_sha256": _sha256(store_manifest),
        "train_sequences": indices_count,
        "settings": {k: getattr(cfg, k) for k in KEY_SETTINGS},
    }
    if what is not None:
        fields["what"] = what
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24], fields


def _sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _cache_path(cache_dir: str | Path, key: str) -> Path:
    return Path(cache_dir) / "choices" / f"{key}.json"


def load_cached(cache_dir: str | Path, key: str) -> MeasuredChoices | None:
    """The stored choice under `key`, or None (absent, of another format, or damaged).

    A damaged entry (unreadable, or a field of the wrong type) is never trusted: a one-line
    warning, and the caller measures again (and overwrites it)."""
    path = _cache_path(cache_dir, key)
    if not path.is_file():
        return None
    try:
        mc = read_choices(path, source="reused")
    except DataError as e:
        first = str(e).splitlines()[-1].strip(" -")
        log.warning(
            f"pitstop: ignoring a damaged measured-choices cache entry ({first}); measuring again"
        )
        return None
    if mc.key != key or mc.key_fields.get("format") != FORMAT:
        return None
    return mc


def save_measured(cache_dir: str | Path, mc: MeasuredChoices) -> bool:
    """Store `mc` (best effort: an unwritable cache only means measuring next time)."""
    text = json.dumps({**mc.to_json(), "source": "measured"}, indent=1, default=str) + "\n"
    return write_cache_entry(_cache_path(cache_dir, mc.key), text)


def read_run_choices(out: str | Path) -> MeasuredChoices | None:
    """The choices a run directory recorded at its start; None when it recorded none.

    A damaged choices.json is a DataError naming the file and the field: a resumed run
    must continue with the choices it started with, never silently with others."""
    path = Path(out) / RUN_CHOICES
    if not path.exists():
        return None
    return read_choices(path, source="run")


def write_run_choices(out: str | Path, mc: MeasuredChoices) -> None:
    write_choices(Path(out) / RUN_CHOICES, mc)


def resolve_measured(
    *,
    key: str,
    key_fields: dict[str, Any],
    cache_dir: str | Path,
    measure: Callable[[], MeasureResult],
    run_dir: str | Path | None = None,
    resume: bool = False,
    remeasure: bool = False,
    store_result: bool = True,
    now: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
) -> MeasuredChoices:
    """The choices for this run: from the run directory on resume, else the cache, else `measure()`.

    `measure()` returns (values, reasons, measurements). A fresh measurement is stored
    in the cache under `key`; `remeasure` skips the cache lookup (never the run's own
    record on resume: a resumed run must continue with what it started with).
    """
    if resume and run_dir is not None:
        kept = read_run_choices(run_dir)
        if kept is not None:
            return kept
    if not remeasure:
        cached = load_cached(cache_dir, key)
        if cached is not None:
            return cached
    values, reasons, measurements = measure()
    mc = MeasuredChoices(
        key=key,
        key_fields=key_fields,
        measured_at=now().isoformat(timespec="seconds"),
        values=values,
        reasons=reasons,
        measurements=measurements,
    )
    if store_result and NOT_MEASURED not in measurements:
        save_measured(cache_dir, mc)
    return mc
