"""The run's precision record: the one a resumed run keeps, the one a measured choice adds
to choices.json, and the CPU measurement that decides bf16 against fp32. Other measured
run choices (train/attention_rows.py) are kept and recorded the same way.

Precision is a run's choice, not a batching one: it is read from and added to the run's
`run_record.ChoiceRecord` here, without going through batching's choices module.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime, timezone
from pathlib import Path

from pitstop import probe
from pitstop.core import run_record
from pitstop.core.cache_layout import cache_root
from pitstop.core.config import RunConfig
from pitstop.core.run_record import ChoiceRecord
from pitstop.measure.peak import model_precision_speed
from pitstop.probe import Choice, DeviceInfo


def kept_precision(cfg: RunConfig, out: Path | None, device: DeviceInfo) -> Choice | None:
    """On --resume with precision auto: the precision the run's choices.json recorded."""
    if cfg.precision != "auto":
        return None
    return kept_choice(cfg, out, "precision")


def kept_choice(cfg: RunConfig, out: Path | None, name: str) -> Choice | None:
    """On --resume: the measured choice `name` the run's choices.json recorded, if any."""
    if not (cfg.resume and out is not None):
        return None
    path = out / run_record.CHOICES
    # A damaged file is refused, naming the field: a resumed run keeps what it started with.
    record = run_record.read_choices(path) if path.exists() else None
    value = record.values.get(name) if record is not None else None
    if value is None:
        return None
    return Choice(value, f"kept from this run (choices.json): {record.reasons.get(name, '')}")


def record_precision(
    record: ChoiceRecord | None, precision: Choice, dev: DeviceInfo
) -> ChoiceRecord | None:
    """The run's measured choices with a measured precision added (written to choices.json
    before step 1, so --resume keeps it); unchanged when precision was not measured."""
    return record_choice(record, "precision", precision, dev)


def record_choice(
    record: ChoiceRecord | None, name: str, choice: Choice, dev: DeviceInfo
) -> ChoiceRecord | None:
    """The run's measured choices with the measured choice `name` added (written to
    choices.json before step 1, so --resume keeps it); unchanged when it was not measured."""
    if choice.measured is None or (record is not None and name in record.values):
        return record
    if record is None:
        now = datetime.now(timezone.utc).isoformat(timespec="seconds")
        record = ChoiceRecord(
            key="run", key_fields={"device": dev.name}, measured_at=now, values={}
        )
    return dataclasses.replace(
        record,
        values={**record.values, name: choice.value},
        reasons={**record.reasons, name: choice.reason},
        measurements={**record.measurements, name: choice.measured},
    )


def cpu_precision_speed(cfg: RunConfig, device: DeviceInfo) -> probe.PrecisionSpeed | None:
    """fp32 against bf16 autocast at the model's matmul shapes, where the probe would weigh
    bf16 on this CPU (measured once per machine and shapes, then cached); else None."""
    if not probe.cpu_bf16_candidate(cfg.precision, device):
        return None
    return model_precision_speed(cache_root(cfg.cache_dir), cfg.model, cfg.max_seq_len)
