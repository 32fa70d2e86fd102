"""The run directory's contract: its file names and the typed records its JSON files hold.

Every writer (`pitstop train`, `pitstop.hf.PitstopCallback`, and any later one) builds a
`RunSummary` and writes it with `write_summary`; every reader (report, compare,
estimate, tune, demo) gets typed records from `read_summary`, `read_steps` and
`read_choices`. The field-by-field contract is docs/run-directory.md.

Reading validates shape as well as syntax: a field of the wrong type is a `DataError`
naming the file (and, in metrics.jsonl, the line) and the field. Keys a reader does not
know are kept in `extra` and written back (a newer writer's fields survive an older
reader), and files written before the schema had a version still load (`schema_version`
is then None).

Torch-free and in the base layer: it imports only `errors` and `atomic`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypedDict

from pitstop.catalog.layouts import LAYOUT_NAMES, choices_text
from pitstop.core.atomic import write_json_atomic, write_text_atomic
from pitstop.core.errors import DataError, short_repr

# --- file names (a rename is one edit; --overwrite knows exactly what a run wrote) ---------

SUMMARY = "summary.json"  # the run's results: a RunSummary (docs/run-directory.md)
METRICS = "metrics.jsonl"  # one StepLine per optimizer step
CONFIG = "config.yaml"  # the run's configuration, for --resume
CHECKPOINTS = "checkpoints"  # checkpoints/step-N/, best.json
FINAL = "final"  # the HF-loadable model (or PEFT adapter)
MERGED = "merged"  # --merge-lora: the adapter merged into its base, a plain HF model
TENSORBOARD = "tensorboard"  # TensorBoard events
PROFILE = "profile.json"  # `pitstop profile --output`'s default name
HF_PROFILE = "pitstop_profile.json"  # the profile PitstopCallback writes beside a HF run
REPORT = "report.html"  # `pitstop report`'s default name
FINDINGS = "findings.json"  # the doctor's report beside a run (`write_findings`)

WANDB_ID = "wandb-run-id"  # the wandb run this run logs to (--resume continues that run)
CHOICES = "choices.json"  # the measured choices the run trains with: a ChoiceRecord

# What `pitstop train` writes, and so what --overwrite removes (never the user's other files).
RUN_FILES = (SUMMARY, METRICS, CONFIG, CHOICES, WANDB_ID)
RUN_DIRS = (CHECKPOINTS, FINAL, MERGED, TENSORBOARD)
# Any of these present means the directory already holds a run.
RUN_MARKERS = (SUMMARY, CHECKPOINTS, FINAL)

# What `RunSummary.source` (and a profile's "source") names: `pitstop train`, the Hugging
# Face PitstopCallback, and a plain PyTorch loop timed by pitstop.watch /
# `pitstop profile -- COMMAND` (pitstop.anyloop.recorder; its settings were observed).
SOURCE_PITSTOP, SOURCE_HF, SOURCE_SCRIPT = "pitstop", "hf", "script"
SOURCES = (SOURCE_PITSTOP, SOURCE_HF, SOURCE_SCRIPT)

# Bump when a field changes meaning. Files without the key are version 0 (before it existed).
# A measured choice's facts carry this key when measuring was skipped because it would not
# pay back on that run (pitstop.batching.payoff): the cost model decided, nothing timed.
NOT_MEASURED = "not_measured"
SCHEMA_VERSION = 1


def no_step_seen(what: str, out: str | Path) -> str:
    """Why `out` holds no run after `what` (e.g. "the command") ran: no optimizer step was
    seen. One wording for `profile -- CMD` and `tune -- CMD`: a command that exited 0
    without one did not fail, it trained nothing pitstop could time."""
    return (
        f"{what} ran no optimizer step that pitstop could see, so {out} holds no run. "
        "pitstop times `optimizer.step()` of torch optimizers and the model's forward in "
        "the Python processes the command starts; a loop without a torch optimizer, or a "
        "process that ends with os._exit or a signal, cannot be timed"
    )


# --- shape checks --------------------------------------------------------------------------

_KINDS: dict[str, tuple[str, Any]] = {
    # kind: (what the message says, test)
    "int": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "num": ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, str)),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "dict": ("an object", lambda v: isinstance(v, dict)),
    "list": ("a list", lambda v: isinstance(v, list)),
    "num_list": (
        "a list of numbers",
        lambda v: isinstance(v, list) and all(_KINDS["num"][1](x) for x in v),
    ),
    "str_list": (
        "a list of strings",
        lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    ),
    "num_map": (
        "an object of numbers",
        lambda v: isinstance(v, dict) and all(_KINDS["num"][1](x) for x in v.values()),
    ),
    "str_map": (
        "an object of strings",
        lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()),
    ),
    "dict_or_str": ("an object or a string", lambda v: isinstance(v, (dict, str))),
    "any": ("anything", lambda v: True),
}


def _kind(kind: str, default: Any = None, *, required: bool = False) -> Any:
    """A dataclass field whose JSON value must be of `kind` (None allowed unless required)."""
    meta = {"kind": kind, "required": required}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(), metadata=meta)
    return field(default=default, metadata=meta)


# The exact JSON types each kind accepts without calling its test (json.loads gives exact
# types; the test still decides for anything else, e.g. a numpy float): reading a long
# run's metrics.jsonl is dominated by these checks.
_FAST: dict[str, tuple[type, ...]] = {
    "int": (int,), "num": (int, float), "str": (str,), "bool": (bool,), "dict": (dict,),
    "list": (list,), "dict_or_str": (dict, str),
}  # fmt: skip
_SPECS: dict[type, list[tuple[str, bool, str, tuple[type, ...], Any]]] = {}


def _specs(cls: type) -> list[tuple[str, bool, str, tuple[type, ...], Any]]:
    """(name, required, what, fast types, test) of each checked field of `cls`, built once."""
    if cls not in _SPECS:
        _SPECS[cls] = [
            (f.name, f.metadata["required"], *_KINDS[f.metadata["kind"]][:1],
             _FAST.get(f.metadata["kind"], ()), _KINDS[f.metadata["kind"]][1])
            for f in fields(cls) if "kind" in f.metadata
        ]  # fmt: skip
    return _SPECS[cls]


class BestCheckpoint(TypedDict):
    """The complete checkpoint with the lowest eval loss (summary.json's `best_checkpoint`)."""

    step: int
    path: str
    eval_loss: float


class EvalRecord(TypedDict):
    """One held-out evaluation: on its step's metrics.jsonl line (all but `step`), in
    summary.json's `eval` and in trainer_state.json's `last_eval`."""

    step: int
    eval_loss: float  # mean CE per eval target token, over all ranks
    eval_ppl: float  # exp(eval_loss); inf above exp(700)
    eval_targets: int
    eval_sequences: int
    eval_seconds: float


class PlannedEfficiency(TypedDict):
    """The epoch-0 plan's efficiency, before running (summary.json's `planned_efficiency`)."""

    packing_efficiency: float
    padding_waste: float


def _check(cls: type, data: Any, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(known fields, extra keys) of `data`, or a DataError naming every field of the wrong type."""
    if not isinstance(data, dict):
        raise DataError(f"{where}: must be a JSON object, got {short_repr(data)}")
    known, problems = {}, []
    specs = _specs(cls)
    for name, required, what, fast, ok in specs:
        v = data.get(name)
        if v is None:
            if required:
                problems.append(f"{where}: field {name!r} is missing")
        elif type(v) in fast or ok(v):
            known[name] = v
        else:
            problems.append(f"{where}: field {name!r} must be {what}, got {short_repr(v)}")
    if problems:
        raise DataError(problems, header=None if len(problems) == 1 else f"{where}:")
    extra = {k: v for k, v in data.items() if k not in known and k != "schema_version"}
    for name, *_ in specs:  # a known field written as null is not an extra key
        extra.pop(name, None)
    return known, extra


def check_fields(data: Any, kinds: dict[str, str], where: str) -> dict[str, Any]:
    """`data` itself when it is an object whose named fields (where present and not null)
    are of the named kinds ("int", "num", "str", "bool", "dict", "list", "num_list",
    "num_map", "str_map", "dict_or_str"); else a DataError naming every field wrong."""
    if not isinstance(data, dict):
        raise DataError(f"{where}: must be a JSON object, got {short_repr(data)}")
    problems = []
    for name, kind in kinds.items():
        v = data.get(name)
        what, ok = _KINDS[kind]
        if v is not None and not ok(v):
            problems.append(f"{where}: field {name!r} must be {what}, got {short_repr(v)}")
    if problems:
        raise DataError(problems, header=None if len(problems) == 1 else f"{where}:")
    return data


def _version(data: dict[str, Any], where: str) -> int:
    v = data.get("schema_version", 0)
    if not _KINDS["int"][1](v):
        raise DataError(f"{where}: field 'schema_version' must be an integer, got {short_repr(v)}")
    if v > SCHEMA_VERSION:
        raise DataError(
            f"{where}: written by a newer pitstop (schema_version {v}, this one reads up to "
            f"{SCHEMA_VERSION}); upgrade pitstop to read it"
        )
    return int(v)


def _finite(v: Any) -> Any:
    """JSON has no NaN/Inf: a non-finite number is written as null."""
    return None if isinstance(v, float) and not math.isfinite(v) else v


def _read_json(path: Path, what: str) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"{path} does not exist; {what}") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text ({e}); {what}") from None
    except OSError as e:
        raise DataError(f"{path} cannot be read ({e.strerror or e})") from None
    try:
        return json.loads(text)
    except ValueError as e:
        raise DataError(f"{path} is not valid JSON ({e}); {what}") from None


# --- summary.json --------------------------------------------------------------------------


@dataclass
class RunSummary:
    """summary.json: what a run did and how fast (docs/run-directory.md, field by field).

    Every field may be null: a run killed early, an older writer, or a writer that cannot
    see a figure (the HF callback has no checkpoint timings) leaves it out.
    """

    status: str | None = _kind("str")  # completed | interrupted | failed | incomplete: ...
    source: str | None = _kind("str")  # one of SOURCES (what produced the run)
    optimizer_steps: int | None = _kind("int")
    total_steps: int | None = _kind("int")
    epochs: float | None = _kind("num")
    trained_tokens: float | None = _kind("num")  # tokens that contributed to the loss
    seen_tokens: float | None = _kind("num")  # non-padding input tokens
    padded_tokens: float | None = _kind("num")  # every position computed, padding included
    rows: int | None = _kind("int")
    train_seconds: float | None = _kind("num")  # first step to last
    wall_seconds: float | None = _kind("num")  # process (or Trainer.train) start to end
    tokens_per_second: float | None = _kind("num")  # trained_tokens / train_seconds
    seen_tokens_per_second: float | None = _kind("num")
    trained_tokens_per_step: float | None = _kind("num")
    mfu: float | None = _kind("num")
    flops_per_token: float | None = _kind("num")
    peak_flops: float | None = _kind("num")
    peak_flops_source: str | None = _kind("str")
    peak_memory_bytes: float | None = _kind("num")
    final_loss: float | None = _kind("num")
    final_loss_step: int | None = _kind("int")
    eval_loss: float | None = _kind("num")
    eval_ppl: float | None = _kind("num")
    eval: EvalRecord | None = _kind("dict")
    best_checkpoint: BestCheckpoint | None = _kind("dict")
    world_size: int | None = _kind("int")
    time_breakdown: dict[str, float] = _kind("num_map", {})  # seconds per phase
    checkpoint_pause_seconds: float | None = _kind("num")
    host_page_faults_per_step: float | None = _kind("num")  # after the first step
    checkpoint_write_seconds: float | None = _kind("num")
    checkpoint_host_buffer_bytes: float | None = _kind("num")
    skipped_steps: int | None = _kind("int")
    packing_efficiency: float | None = _kind("num")
    padding_waste: float | None = _kind("num")
    planned_efficiency: PlannedEfficiency | None = _kind("dict")  # the epoch-0 plan
    device: dict[str, Any] | str | None = _kind("dict_or_str")
    machine: dict[str, Any] | None = _kind("dict")  # the load the figures were measured under
    choices: dict[str, Any] = _kind("dict", {})  # name: {"value", "reason"}
    measured_choices: dict[str, Any] | None = _kind("dict")
    resumed_from: str | None = _kind("str")
    final_model: str | None = _kind("str")
    config: dict[str, Any] = _kind("dict", {})
    requested: dict[str, Any] | None = _kind("dict")
    profile: dict[str, Any] | None = _kind("dict")
    # A plain loop's command line (`pitstop profile -- COMMAND`) and the directory it ran in:
    # what `compare --rerun` reruns. Version-1 files kept the same keys, so they read alike.
    command: list[str] | None = _kind("str_list")
    command_cwd: str | None = _kind("str")
    schema_version: int = SCHEMA_VERSION
    extra: dict[str, Any] = field(default_factory=dict)  # keys this version does not know

    def to_json(self) -> dict[str, Any]:
        # Written as this version's record: `schema_version` says which one was read.
        d = {f.name: getattr(self, f.name) for f in fields(self) if "kind" in f.metadata}
        return {"schema_version": SCHEMA_VERSION, **d, **self.extra}

    @classmethod
    def from_json(cls, data: Any, where: str = "summary.json") -> RunSummary:
        known, extra = _check(cls, data, where)
        return cls(**known, schema_version=_version(data, where), extra=extra)

    @property
    def device_name(self) -> str:
        """The device as a person reads it: a DeviceInfo's name, or the string written."""
        d = self.device
        if isinstance(d, dict):
            name, typ = d.get("name"), d.get("type")
            return str(name or typ or "unknown")
        return str(d) if d else "unknown"

    @property
    def ranks_counted(self) -> int:
        """How many ranks' batches the token counts hold: `pitstop train` sums every rank's
        (its counts are all-reduced); the HF callback and the any-loop timer count what rank
        0 trained (each rank trains its own shard). Per-rank figures × world size / this =
        the run's total (docs/run-directory.md)."""
        return (self.world_size or 1) if self.source == SOURCE_PITSTOP else 1

    @property
    def whole_run_factor(self) -> float:
        """What the token counts are multiplied by to cover every rank: the world size for a
        writer that counts rank 0's batches, 1 where they are summed already."""
        return (self.world_size or 1) / self.ranks_counted

    def choice_reason(self, name: str) -> str:
        """Why choice `name` was made ("" when not recorded)."""
        c = self.choices.get(name)
        return str(c.get("reason") or "") if isinstance(c, dict) else ""

    def choice_values(self) -> dict[str, Any]:
        """Each choice's value ({"value", "reason"} records, or a bare value)."""
        return {k: v.get("value") if isinstance(v, dict) else v for k, v in self.choices.items()}


def write_summary(out_dir: str | Path, summary: RunSummary) -> Path:
    """Write OUT_DIR/summary.json atomically (the one writer every run uses); its path."""
    path = Path(out_dir) / SUMMARY
    clean = {k: _finite(v) for k, v in summary.to_json().items()}
    write_json_atomic(path, clean)
    return path


def write_findings(out_dir: str | Path, report: dict[str, Any]) -> Path:
    """Write OUT_DIR/findings.json atomically: the doctor's whole report, its "findings" a
    list (the one writer the doctor command, the demo and PitstopCallback use); its path."""
    if not isinstance(report.get("findings"), list):
        raise ValueError("a findings.json report holds a list under 'findings'")
    path = Path(out_dir) / FINDINGS
    write_json_atomic(path, report)
    return path


def read_summary(path: str | Path) -> RunSummary:
    """A summary.json (or a run directory holding one), validated; DataError otherwise."""
    p = Path(path)
    if p.is_dir():
        p = p / SUMMARY
    what = "give the summary.json of a `pitstop train` run or a PitstopCallback run"
    return RunSummary.from_json(_read_json(p, what), str(p))


# --- metrics.jsonl -------------------------------------------------------------------------

# Flat keys ending in "_s" that are not step phases.
_NOT_PHASES = {"step", "elapsed", "time", "wall", "train", "step_time", "total", "eta"}


@dataclass
class StepLine:
    """One metrics.jsonl line: one optimizer step.

    `phases` holds the step's seconds per phase (data_wait, host_to_device, forward,
    backward, optimizer, checkpoint, eval, logging, other), written as flat `<phase>_s`
    keys; `step_seconds` is the step's wall time. Token counts are cumulative over the
    run except `step_trained_tokens`.
    """

    step: int = _kind("int", 0, required=True)
    epoch: float | None = _kind("num")
    lr: float | None = _kind("num")
    loss: float | None = _kind("num")  # null: a skipped (non-finite) step
    grad_norm: float | None = _kind("num")
    skipped: bool | None = _kind("bool")
    warmup: bool | None = _kind("bool")  # PitstopCallback: left out of the profile
    trained_tokens: float | None = _kind("num")
    seen_tokens: float | None = _kind("num")
    padded_tokens: float | None = _kind("num")
    step_trained_tokens: float | None = _kind("num")
    step_rows: int | None = _kind("int")
    tokens_per_second: float | None = _kind("num")
    step_seconds: float | None = _kind("num")
    mfu: float | None = _kind("num")
    eval_loss: float | None = _kind("num")
    eval_ppl: float | None = _kind("num")
    peak_memory_gib: float | None = _kind("num")
    weights_finite: bool | None = _kind("bool")
    phases: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def data_wait_s(self) -> float:
        return self.phases.get("data_wait", 0.0)

    @property
    def pause_s(self) -> float:
        """Checkpoint and evaluation time inside this step (a long run pays them at its cadence)."""
        return self.phases.get("checkpoint", 0.0) + self.phases.get("eval", 0.0)

    @property
    def seconds(self) -> float | None:
        """The step's wall time: `step_seconds`, else its phases added up (None if neither)."""
        if self.step_seconds is not None:
            return float(self.step_seconds)
        return sum(self.phases.values()) if self.phases else None

    def number(self, key: str) -> float | None:
        """A numeric field or extra key by name (a finite number, else None)."""
        v = getattr(self, key) if key in _STEP_FIELDS else self.extra.get(key)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        return float(v) if ok else None

    def to_json(self) -> dict[str, Any]:
        # Null fields are left out, except the loss: null there says the step was skipped.
        d = {
            k: getattr(self, k) for k in _STEP_FIELDS if getattr(self, k) is not None or k == "loss"
        }
        d.update({f"{k}_s": v for k, v in self.phases.items()})
        return {**d, **self.extra}

    @classmethod
    def from_json(cls, data: Any, where: str = "metrics.jsonl") -> StepLine:
        known, extra = _check(cls, data, where)
        phases, problems = {}, []
        nested = extra.pop("phases", None)
        if nested is None:
            nested = extra.pop("time_breakdown", None)
        if nested is not None:  # an older or foreign writer: {"phases": {name: seconds}}
            if not _KINDS["num_map"][1](nested):
                problems.append(f"{where}: field 'phases' must be an object of numbers")
            else:
                phases = {str(k).removesuffix("_s"): float(v) for k, v in nested.items()}
        for k in [k for k in extra if k.endswith("_s") and k[:-2] not in _NOT_PHASES]:
            v = extra.pop(k)
            if v is None:
                continue
            if type(v) not in (int, float) and not _KINDS["num"][1](v):
                problems.append(f"{where}: field {k!r} must be a number, got {short_repr(v)}")
            elif nested is None:
                phases[k[:-2]] = float(v)
        if problems:
            raise DataError(problems, header=None if len(problems) == 1 else f"{where}:")
        return cls(**known, phases=phases, extra=extra)


_STEP_FIELDS = tuple(f.name for f in fields(StepLine) if "kind" in f.metadata)


def read_steps(path: str | Path) -> list[StepLine]:
    """The step lines of a metrics.jsonl, validated; [] when the file does not exist.

    The last line may be cut short by a crash (writers append whole lines, so only the
    last can be torn) and is skipped. Any other line that is not a JSON object of the
    right shape is a DataError naming the file, the line and the field. A line without
    a "step" takes its line number.
    """
    p = Path(path)
    if not p.is_file():
        return []
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{p} is not UTF-8 text ({e}); it is not a pitstop metrics file") from None
    except OSError as e:
        raise DataError(f"{p} cannot be read ({e.strerror or e})") from None
    lines = text.split("\n")[:-1]  # the piece after the last newline: "" or a torn line
    steps = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{p} line {i}"
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise DataError(
                f"{where} is not valid JSON ({e}): {line[:80]!r}; remove or repair that "
                "line (each line is one optimizer step)"
            ) from None
        if isinstance(rec, dict) and "step" not in rec:
            rec = {**rec, "step": i}
        steps.append(StepLine.from_json(rec, where))
    return steps


def write_steps(out_dir: str | Path, steps: list[StepLine]) -> Path:
    """Write OUT_DIR/metrics.jsonl whole, atomically (a writer that has every step at the end,
    like PitstopCallback; `pitstop train` appends lines as it runs). Non-finite numbers are null."""
    path = Path(out_dir) / METRICS
    text = "".join(
        json.dumps({k: _finite(v) for k, v in s.to_json().items()}) + "\n" for s in steps
    )
    write_text_atomic(path, text)
    return path


# --- choices.json and the measured-choices cache -------------------------------------------


# The measured values a run trains with, and what each must be (the trainer uses them as is).
_CHOICE_VALUES: dict[str, tuple[str, Any]] = {
    "batching": (f"one of {choices_text()}", lambda v: v in LAYOUT_NAMES),
    "precision": ("one of 'fp32', 'bf16', 'fp16'", lambda v: v in ("fp32", "bf16", "fp16")),
    "micro_batch_rows": (
        "a positive integer",
        lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
    ),
    "attention_rows": ("true or false", lambda v: isinstance(v, bool)),
}


@dataclass
class ChoiceRecord:
    """Measured choices: resolved values (e.g. {"batching": "bucket"}), why, the measurements
    behind them, and the key of what they depend on (choices.json; a cache entry)."""

    key: str = _kind("str", "", required=True)
    key_fields: dict[str, Any] = _kind("dict", {}, required=True)
    measured_at: str = _kind("str", "", required=True)  # ISO 8601, UTC
    values: dict[str, Any] = _kind("dict", {}, required=True)
    reasons: dict[str, str] = _kind("str_map", {})
    measurements: dict[str, Any] = _kind("dict", {})
    source: str = "measured"  # measured | reused (from the cache) | run (the run directory)

    def describe(self, name: str) -> str:
        """The banner's reason for `name`: how it was decided, when, and the numbers."""
        if NOT_MEASURED in self.measurements:  # the cost model decided: nothing was timed
            kept = "kept from this run: " if self.source == "run" else ""
            return f"{kept}{self.reasons.get(name, '')}"
        when = _human_time(self.measured_at)
        how = {
            "measured": f"measured {when}",
            "reused": f"reused, measured {when} (--remeasure measures again)",
            "run": f"kept from this run, measured {when} (a resumed run never re-measures)",
        }.get(self.source, f"{self.source}, measured {when}")
        return f"{how}: {self.reasons.get(name, '')}".rstrip(": ")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, **self.to_dict()}

    @classmethod
    def from_json(cls, data: Any, where: str = "choices.json", source: str = "run") -> ChoiceRecord:
        known, _ = _check(cls, data, where)
        _version(data, where)
        problems = [
            f"{where}: field 'values.{name}' must be {what}, got {short_repr(known['values'][name])}"
            for name, (what, ok) in _CHOICE_VALUES.items()
            if name in known["values"] and not ok(known["values"][name])
        ]
        if problems:
            raise DataError(problems, header=None if len(problems) == 1 else f"{where}:")
        return cls(**known, source=source)

    def merged(self, other: ChoiceRecord, name: str) -> ChoiceRecord:
        """One record of both (the run directory keeps one `choices.json`): `other`'s values
        and reasons join these, its measurements go under `name`."""
        return ChoiceRecord(
            key=self.key, key_fields=self.key_fields, measured_at=self.measured_at,
            values={**self.values, **other.values}, reasons={**self.reasons, **other.reasons},
            measurements={**self.measurements, name: other.measurements}, source=self.source,
        )  # fmt: skip


def read_choices(path: str | Path, source: str = "run") -> ChoiceRecord:
    """A choices.json (or a measured-choices cache entry), validated; DataError otherwise."""
    p = Path(path)
    what = "delete it to measure again (or start the run afresh without --resume)"
    return ChoiceRecord.from_json(_read_json(p, what), str(p), source)


def write_choices(path: str | Path, record: ChoiceRecord) -> None:
    write_json_atomic(path, record.to_json())


def _human_time(iso: str) -> str:
    try:
        t = datetime.fromisoformat(iso).astimezone(timezone.utc)
    except ValueError:
        return iso
    return t.strftime("%Y-%m-%d %H:%M UTC")
