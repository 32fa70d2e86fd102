"""Hugging Face TrainingArguments / TRL SFTConfig fields, read from a JSON or YAML mapping.

The file is a plain mapping of field: value (what `TrainingArguments.to_dict()` or a
TRL YAML config holds). It is never used to instantiate TrainingArguments: that
would validate against this machine (e.g. refuse `bf16=True` without a GPU) while
the user may be auditing a config for another one. Fields not given take the
defaults of the installed transformers (read from the dataclass declaration), with
SFTConfig's own defaults where it overrides them (TRL documents: logging_steps 10,
gradient_checkpointing True, bf16 True unless fp16).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

from pitstop.advise.setup import UNKNOWN, Setup
from pitstop.catalog.layouts import Layout
from pitstop.core.config_ranges import MAX_COUNT
from pitstop.core.errors import ConfigError, short_repr
from pitstop.core.quiet_imports import without_bitsandbytes
from pitstop.core.yaml_load import parse_yaml

# SFTConfig fields that TrainingArguments lacks (TRL 1.x, plus older names); their presence
# marks a file as an SFTConfig. Kept here so the doctor works without TRL installed.
SFT_FIELDS = frozenset({
    "activation_offloading", "assistant_only_loss", "chat_template_path", "completion_only_loss",
    "dataset_kwargs", "dataset_num_proc", "dataset_text_field", "eos_token", "eval_packing",
    "loss_type", "max_length", "model_init_kwargs", "packing", "packing_strategy",
    "pad_to_multiple_of", "pad_token", "padding_free", "router_aux_loss_coef", "shuffle_dataset",
    "truncation_mode", "trust_remote_code", "max_seq_length", "dataset_batch_size", "num_of_sequences",
    "chars_per_token", "use_liger", "neftune_noise_alpha",
})  # fmt: skip
# Field names of older transformers releases that a saved config may still hold.
LEGACY_FIELDS = frozenset({
    "group_by_length", "evaluation_strategy", "no_cuda", "per_gpu_train_batch_size",
    "per_gpu_eval_batch_size", "overwrite_output_dir", "logging_dir", "push_to_hub_token",
    "use_mps_device", "fp16_backend", "half_precision_backend", "use_ipex", "warmup_ratio",
})  # fmt: skip
# SFTConfig's overrides of TrainingArguments defaults (TRL's SFTConfig docstring).
SFT_DEFAULTS = {"logging_steps": 10, "gradient_checkpointing": True, "max_length": 1024,
                "packing": False, "padding_free": False}  # fmt: skip
# Fields the rules read; every other given field is reported as "not checked".
CHECKED = frozenset({
    "dataloader_num_workers", "packing", "padding_free", "group_by_length",
    "train_sampling_strategy", "max_length", "max_seq_length", "bf16", "fp16", "tf32",
    "gradient_checkpointing", "activation_checkpointing", "optim", "torch_compile",
    "per_device_train_batch_size", "gradient_accumulation_steps", "save_strategy", "save_steps",
    "logging_strategy", "logging_steps", "eval_strategy", "evaluation_strategy", "eval_steps",
    "torch_empty_cache_steps", "logging_nan_inf_filter", "use_cpu", "no_cuda",
})  # fmt: skip


# What each field the rules read must hold in a declared file (TrainingArguments' and
# SFTConfig's own types), with the range where it means something: a wrong type or an
# absurd number would otherwise become a finding about it (`dataloader_num_workers: 1e30`
# was "1000000000000000019884624838656 loader workers on 2 CPU cores").
_WORKERS_MAX = 1024  # DataLoader worker processes: far above any machine's cores
_STRATEGIES = ("no", "steps", "epoch", "best")
_STEPS = "an integer of at least 1 (or a fraction of the run in (0, 1))"
FIELD_KINDS: dict[str, tuple[str, Any]] = {
    **{k: ("bool", None) for k in (
        "packing", "padding_free", "group_by_length", "bf16", "fp16", "gradient_checkpointing",
        "activation_checkpointing", "torch_compile", "logging_nan_inf_filter", "use_cpu",
        "no_cuda")},
    "tf32": ("bool_or_none", None),
    "dataloader_num_workers": ("int", (0, _WORKERS_MAX)),
    "per_device_train_batch_size": ("int", (1, MAX_COUNT)),
    "gradient_accumulation_steps": ("int", (1, MAX_COUNT)),
    "max_length": ("int_or_none", (1, MAX_COUNT)),
    "max_seq_length": ("int_or_none", (1, MAX_COUNT)),
    "torch_empty_cache_steps": ("int_or_none", (1, MAX_COUNT)),
    **{k: ("steps", None) for k in ("save_steps", "logging_steps", "eval_steps")},
    **{k: ("choice", _STRATEGIES) for k in (
        "save_strategy", "logging_strategy", "eval_strategy", "evaluation_strategy")},
    "train_sampling_strategy": ("str", None),
    "optim": ("str", None),
}  # fmt: skip


def declared_problems(values: dict[str, Any]) -> list[str]:
    """One line per field of a declared file that holds what TrainingArguments would not:
    a wrong type, a number outside its range, or a non-finite number anywhere (JSON's
    NaN/Infinity, or 1e400)."""
    out = []
    for name, v in values.items():
        if isinstance(v, float) and not math.isfinite(v):
            out.append(f"{name} is {v}; give a finite number")
            continue
        if name not in FIELD_KINDS:
            continue
        kind, arg = FIELD_KINDS[name]
        want = _kind_problem(kind, arg, v)
        if want:
            out.append(f"{name} is {short_repr(v)}; it must be {want}")
    return out


def _kind_problem(kind: str, arg: Any, v: Any) -> str | None:
    """What `v` should have been, or None when it is fine."""
    v = getattr(v, "value", v)  # an enum (IntervalStrategy, OptimizerNames) as its string
    is_int = isinstance(v, int) and not isinstance(v, bool)
    if kind == "bool" or (kind == "bool_or_none" and v is not None):
        return None if isinstance(v, bool) else "true or false"
    if kind in ("int", "int_or_none") and not (kind == "int_or_none" and v is None):
        lo, hi = arg
        span = f"of at least {lo}" if hi == MAX_COUNT else f"from {lo} to {hi:,}"
        return None if is_int and lo <= v <= hi else f"an integer {span}"
    if kind == "steps" and v is not None:
        ok = (is_int and 1 <= v <= MAX_COUNT) or (isinstance(v, float) and 0 < v < 1)
        return None if ok else _STEPS
    if kind == "choice":
        return None if v in arg else "one of " + ", ".join(repr(c) for c in arg)
    if kind == "str" and v is not None and not isinstance(v, str):
        return "a name (a string)"
    return None


@cache
def training_args_defaults() -> dict[str, Any]:
    """{field: default} of the installed TrainingArguments, without instantiating it."""
    try:
        with without_bitsandbytes():  # TrainingArguments imports peft, peft bitsandbytes
            from transformers import TrainingArguments
    except ImportError:  # transformers is a pitstop dependency; stay usable without it anyway
        return {}
    out: dict[str, Any] = {}
    for f in dataclasses.fields(TrainingArguments):
        if f.default is not dataclasses.MISSING:
            out[f.name] = getattr(f.default, "value", f.default)  # enums -> their string
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = None
    return out


def transformers_major() -> int:
    try:
        from importlib.metadata import version

        return int(version("transformers").split(".")[0])
    except Exception:
        return 5


def load_hf_args(path: str | Path) -> dict[str, Any]:
    """Read a JSON or YAML mapping of TrainingArguments / SFTConfig fields."""
    p = Path(path)
    if not p.is_file():
        what = "is a directory" if p.is_dir() else "does not exist"
        raise ConfigError(
            f"--hf-args {p} {what}; give a JSON or YAML file of TrainingArguments fields"
        )
    text = p.read_text(encoding="utf-8", errors="replace")
    try:
        if p.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            # YAML is a superset of JSON, so .yaml/.yml/other; bounded against alias bombs
            data = parse_yaml(text, f"--hf-args {p}")
    except json.JSONDecodeError as e:  # parse_yaml raises a ConfigError of its own
        raise ConfigError(f"--hf-args {p}: not valid JSON ({e}); fix the syntax") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"--hf-args {p}: must be a mapping of field: value "
            f"(e.g. the output of TrainingArguments.to_dict()), got {type(data).__name__}"
        )
    problems = declared_problems(data)
    if problems:
        raise ConfigError(
            [*problems, "fix these fields (TrainingArguments would refuse or misread them)"],
            header=f"--hf-args {p}: {len(problems)} field(s) hold what TrainingArguments would not:",
        )
    return data


def detect_class(values: dict[str, Any], requested: str = "auto") -> str:
    if requested != "auto":
        return requested
    return "SFTConfig" if SFT_FIELDS & set(values) else "TrainingArguments"


def class_reason(values: dict[str, Any], requested: str = "auto") -> str:
    """Which class the fields are read as, and why (the doctor prints it)."""
    cls = detect_class(values, requested)
    if requested != "auto":
        return f"{cls} (--hf-class)"
    sft = sorted(SFT_FIELDS & set(values))
    if sft:
        return (
            f"SFTConfig (it has the SFTConfig-only field(s) {', '.join(sft)}; TRL's defaults apply)"
        )
    return "TrainingArguments (no SFTConfig-only field; give --hf-class SFTConfig for TRL)"


def classify_fields(values: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(unknown fields with a did-you-mean, known fields no rule checks) among those given."""
    known = set(training_args_defaults()) | SFT_FIELDS | LEGACY_FIELDS
    unknown, unchecked = [], []
    for k in values:
        if known and k not in known:
            close = difflib.get_close_matches(k, sorted(known), n=1, cutoff=0.75)
            unknown.append(f"{k} (did you mean {close[0]}?)" if close else k)
        elif k not in CHECKED:
            unchecked.append(k)
    return unknown, unchecked


def _int(v: Any) -> int | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return int(f) if f >= 1 and f.is_integer() else None  # HF: a float < 1 is a ratio of the run


@dataclasses.dataclass(frozen=True)
class _Fields:
    """How `from_hf_args` reads a field: the first of its names the values give, else the
    first with a default (`merged`: the class's defaults under the values). In a record
    (`recorded`) a field not given is unknown (None), never its default."""

    values: Mapping[str, Any]
    merged: Mapping[str, Any]
    recorded: bool

    def get(self, *names: str, default: Any = None) -> Any:
        for n in names:
            if n in self.values:
                return self.values[n]
        for n in names:
            if n in self.merged and self.merged[n] is not None:
                return self.merged[n]
        return None if self.recorded else default

    def given(self, *names: str) -> bool:
        """Whether the field is known: always in a declared file (its default stands)."""
        return not self.recorded or any(n in self.values for n in names)

    def every(
        self, strategy_keys: tuple[str, ...], steps_key: str, fallback: Any = None
    ) -> int | None:
        """The steps between events when their strategy is "steps", else None."""
        raw = self.get(*strategy_keys, default="no")
        strategy = str(getattr(raw, "value", raw))  # an IntervalStrategy enum or its string
        if strategy != "steps":
            return None
        return _int(self.get(steps_key, default=fallback))

    def flag(self, *names: str, default: bool) -> bool | None:
        return bool(self.get(*names, default=default)) if self.given(*names) else None


def _fields(values: Mapping[str, Any], cls: str, recorded: bool) -> _Fields:
    defaults = {} if recorded else dict(training_args_defaults())
    if cls == "SFTConfig" and not recorded:
        defaults.update(SFT_DEFAULTS)
        defaults["bf16"] = None  # resolved in _precision: TRL makes it `not fp16`
    return _Fields(values, {**defaults, **values}, recorded)


def _precision(f: _Fields, cls: str) -> str:
    if not f.given("bf16", "fp16"):
        return UNKNOWN
    fp16 = bool(f.get("fp16", default=False))
    bf16 = f.get("bf16")
    if bf16 is None:
        bf16 = (not fp16) if cls == "SFTConfig" else False
    return "bf16" if bf16 else ("fp16" if fp16 else "fp32")


def _batching(f: _Fields, cls: str) -> str:
    """pitstop's name for how the run forms its rows."""
    if cls == "SFTConfig" and (
        f.get("packing", default=False) or f.get("padding_free", default=False)
    ):
        return Layout.PACK.value
    if (
        f.get("group_by_length", default=False)
        or f.get("train_sampling_strategy") == "group_by_length"
    ):
        return Layout.BUCKET.value  # length-grouped batches: pitstop's bucket
    if f.given("packing", "padding_free", "group_by_length", "train_sampling_strategy"):
        return "dynamic"  # the default collators pad each batch to its longest row
    # A custom loop's collator: padded, packed or fixed-length, the timer cannot tell.
    return UNKNOWN


def _max_len(f: _Fields, cls: str) -> int | None:
    """SFTConfig's max length; a recorded one is a fact whatever the class (none: unknown)."""
    if cls == "SFTConfig" or f.recorded:
        return _int(f.get("max_length", "max_seq_length"))
    return None


def _optimizer(f: _Fields) -> str | None:
    optim = f.get("optim")  # an OptimizerNames enum or its string
    return str(getattr(optim, "value", optim) or "") or (None if f.recorded else "adamw_torch")


def from_hf_args(
    values: dict[str, Any], hf_class: str = "auto", *, recorded: bool = False
) -> Setup:
    """HF TrainingArguments / SFTConfig values (a mapping) as a Setup.

    `recorded`: the values are what a profiled run recorded (a profile's "config"), not a
    file the user declares. A declared file means TrainingArguments, so a field it omits
    takes its default; a record of a custom loop holds only what the timer observed, and a
    field it omits is unknown (None, or UNKNOWN for the string fields), never the default.
    """
    cls = detect_class(values, hf_class)
    f = _fields(values, cls, recorded)
    log_steps = f.every(("logging_strategy",), "logging_steps")
    tf32 = f.get("tf32")
    workers = _int(f.get("dataloader_num_workers", default=0))
    return Setup(
        source="hf",
        raw=dict(values),
        hf_class=cls,
        loader_workers=(workers or 0) if f.given("dataloader_num_workers") else None,
        batching=_batching(f, cls),
        max_len=_max_len(f, cls),
        max_len_key="max_seq_length" if "max_seq_length" in values else "max_length",
        precision=_precision(f, cls),
        tf32=None if tf32 is None else bool(tf32),
        gradient_checkpointing=f.flag(
            "activation_checkpointing", "gradient_checkpointing", default=False
        ),
        optimizer=_optimizer(f),
        compile=("on" if f.get("torch_compile", default=False) else "off")
        if f.given("torch_compile")
        else UNKNOWN,
        micro_batch_rows=_int(f.get("per_device_train_batch_size", default=8)),
        grad_accum=_int(f.get("gradient_accumulation_steps", default=1)),
        world=1,
        save_steps=f.every(("save_strategy",), "save_steps"),
        log_steps=log_steps,
        eval_steps=f.every(("eval_strategy", "evaluation_strategy"), "eval_steps", log_steps),
        empty_cache_steps=_int(f.get("torch_empty_cache_steps")),
        nan_inf_filter=f.flag("logging_nan_inf_filter", default=True),
        transformers_major=transformers_major(),
        recorded=frozenset(values) if recorded else None,
    )
