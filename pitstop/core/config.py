"""The one typed run configuration that YAML files and CLI flags both fill.

Every field is documented where it is declared; the CLI builds its flags and help
from these declarations, so a YAML key and a flag always mean the same thing
(`max_seq_len: 1024` in YAML is `--max-seq-len 1024` on the command line).

Validation gathers every problem (unknown key with "did you mean", wrong type,
value outside its choices, impossible combination) into one `ConfigError`
(exit code 2) before anything is written.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from pitstop.catalog.layouts import LAYOUT_NAMES, Layout
from pitstop.core.config_ranges import range_problems
from pitstop.core.errors import ConfigError, short_repr
from pitstop.core.hub import resolve_model
from pitstop.core.yaml_load import read_yaml

Format = Literal["auto", "jsonl", "json", "parquet", "arrow", "csv", "text"]
# `auto`, then every layout of the catalogue (pitstop.catalog.layouts): a new layout is a
# valid --batching value, in help and errors, without an edit here.
Batching = Literal[("auto", *LAYOUT_NAMES)]  # type: ignore[valid-type]
Precision = Literal["auto", "bf16", "fp16", "fp32"]
OnOffAuto = Literal["auto", "on", "off"]
Device = Literal["auto", "cpu", "cuda"]
Attention = Literal["auto", "flash_attention_2", "flex_attention", "sdpa_docs", "sdpa", "eager"]

# --max-record-seconds: normal records render in milliseconds; one that takes a minute is a
# template far worse than linear in the turns, and would hold every later chunk back.
DEFAULT_MAX_RECORD_SECONDS = 60.0

PREPARE = "prepare"
TRAIN = "train"
# Commands that run training steps take every training flag.
RUNNERS = (TRAIN, "profile", "tune")


def _f(default: Any, help: str, *, cmds: tuple[str, ...] = (PREPARE, *RUNNERS), **kw: Any) -> Any:
    meta = {"help": help, "cmds": cmds, **kw}
    if isinstance(default, list):
        return field(default_factory=lambda d=default: list(d), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class RunConfig:
    """Everything a pitstop run needs. Field names are the YAML keys."""

    # --- inputs -------------------------------------------------------------
    data: list[str] = _f([], "dataset file(s) or a prepared token store (repeatable)")
    model: str | None = _f(
        None, "local Hugging Face model directory (config, safetensors, tokenizer)"
    )
    tokenizer: str | None = _f(
        None, "tokenizer directory, when it differs from --model", cmds=(PREPARE, *RUNNERS)
    )
    output: str | None = _f(None, "output directory of the run", cmds=RUNNERS)
    cache_dir: str | None = _f(
        None, "token-store cache (default: $PITSTOP_CACHE_DIR or ~/.cache/pitstop)"
    )
    format: Format = _f("auto", "input format; auto detects it from the file extension")
    text_field: str = _f("text", "record field holding plain text")
    prompt_field: str = _f("prompt", "record field holding the prompt")
    completion_field: str = _f("completion", "record field holding the completion")
    instruction_field: str = _f("instruction", "record field holding the instruction")
    input_field: str = _f("input", "record field holding the (optional) instruction input")
    output_field: str = _f("output", "record field holding the instruction's answer")
    messages_field: str = _f("messages", "record field holding chat messages")
    template: str = _f(
        "alpaca",
        "prompt template for instruction records: 'alpaca' or a string with {instruction} and {input}",
    )
    max_seq_len: int = _f(
        1024, "longest row in tokens; longer documents are handled by --long-docs"
    )
    workers: int = _f(0, "tokenizer processes for prepare (0 = one per CPU core)")
    on_bad_record: Literal["error", "skip"] = _f(
        "error", "what to do with a record that cannot be read"
    )
    max_record_seconds: float = _f(
        DEFAULT_MAX_RECORD_SECONDS,
        "seconds rendering one record (a chat template) may take; a record still rendering "
        "then is skipped and counted (0 = no limit)",
    )
    long_docs: Literal["split", "truncate", "drop"] = _f(
        "split", "documents longer than --max-seq-len: split into chunks, truncate, or drop"
    )
    train_on_prompt: bool = _f(False, "also compute the loss on prompt tokens")
    trust_remote_code: bool = _f(False, "allow code from the model directory to run")
    recheck_data: bool = _f(
        False,
        "hash every data file again instead of trusting its size and modification time "
        "(an edit that keeps both is otherwise served from the cache)",
    )
    split: str = _f("train", "split to read from a datasets DatasetDict directory (save_to_disk)")

    # --- batching -----------------------------------------------------------
    batching: Batching = _f(
        "auto",
        "how documents become rows: "
        + ", ".join(f"{m} ({m.description})" for m in Layout)
        + ", or auto (chosen for this model and device)",
        cmds=RUNNERS,
    )
    tokens_per_step: int | None = _f(
        None, "tokens per optimizer step (the unit of the training math)", cmds=RUNNERS
    )
    micro_batch_size: int | None = _f(None, "rows per micro-batch", cmds=RUNNERS)
    tokens_per_micro_batch: int | None = _f(
        None, "micro-batch size in tokens (positions computed) instead of rows", cmds=RUNNERS
    )
    grad_accum: int | None = _f(None, "micro-batches per optimizer step", cmds=RUNNERS)
    loader_workers: int | None = _f(
        None, "DataLoader worker processes (default: chosen from the CPU count)", cmds=RUNNERS
    )
    prefetch_factor: int = _f(2, "batches each loader worker keeps ready", cmds=RUNNERS)
    pin_memory: OnOffAuto = _f("auto", "page-locked host batches (only with CUDA)", cmds=RUNNERS)

    # --- training -----------------------------------------------------------
    epochs: float | None = _f(
        None, "passes over the data (default 1 when --max-steps is unset)", cmds=RUNNERS
    )
    max_steps: int | None = _f(None, "stop after this many optimizer steps", cmds=RUNNERS)
    lr: float = _f(3e-4, "peak learning rate", cmds=RUNNERS)
    min_lr_ratio: float = _f(0.1, "final learning rate as a fraction of --lr", cmds=RUNNERS)
    warmup_steps: int | None = _f(
        None, "linear warm-up steps (default: 5% of the run)", cmds=RUNNERS
    )
    schedule: Literal["cosine", "linear", "constant"] = _f(
        "cosine", "decay after warm-up", cmds=RUNNERS
    )
    weight_decay: float = _f(
        0.0, "AdamW weight decay (never applied to norms and biases)", cmds=RUNNERS
    )
    max_grad_norm: float = _f(1.0, "gradient clipping threshold (0 disables)", cmds=RUNNERS)
    seed: int = _f(0, "seed for data order, initialisation and dropout", cmds=RUNNERS)
    precision: Precision = _f(
        "auto", "bf16 where supported, fp16 on older GPUs, fp32 on CPU", cmds=RUNNERS
    )
    attention: Attention = _f("auto", "attention kernel", cmds=RUNNERS)
    compile: OnOffAuto = _f("auto", "torch.compile the model", cmds=RUNNERS)
    keep_freed_memory: OnOffAuto = _f(
        "auto",
        "keep freed host memory for the next step instead of handing it back to the OS "
        "(glibc; auto: on when training on the CPU)",
        cmds=RUNNERS,
    )
    gradient_checkpointing: bool = _f(
        False, "recompute activations in backward to save memory", cmds=RUNNERS
    )
    lora_r: int | None = _f(None, "train a LoRA adapter of this rank (needs peft)", cmds=RUNNERS)
    lora_alpha: float | None = _f(None, "LoRA alpha (default 2 x rank)", cmds=RUNNERS)
    lora_dropout: float = _f(0.0, "LoRA dropout", cmds=RUNNERS)
    lora_target_modules: list[str] = _f(
        [], "modules to adapt (default: all linear layers)", cmds=RUNNERS
    )
    load_in_4bit: bool = _f(
        False, "4-bit base weights (QLoRA; needs bitsandbytes, >= 0.45 on the CPU)", cmds=RUNNERS
    )
    device: Device = _f("auto", "where to train", cmds=RUNNERS)
    strategy: Literal["ddp", "fsdp"] = _f("ddp", "data parallelism across processes", cmds=RUNNERS)
    nproc: int = _f(1, "launch this many processes with torchrun", cmds=RUNNERS)
    optimizer: Literal["adamw", "adamw_8bit", "paged_adamw_8bit"] = _f(
        "adamw",
        "adamw (torch, fp32 moments), or bitsandbytes' 8-bit AdamW (paged: moments can spill "
        "to host memory); 8-bit moments save 6 bytes per trainable parameter",
        cmds=RUNNERS,
    )
    adam_betas: str = _f("0.9,0.95", "AdamW beta1,beta2", cmds=RUNNERS)

    # --- checkpoints, evaluation, logging -----------------------------------
    save_steps: int | None = _f(None, "checkpoint every N optimizer steps", cmds=RUNNERS)
    save_minutes: float | None = _f(None, "checkpoint every M minutes", cmds=RUNNERS)
    save_total_limit: int = _f(2, "checkpoints kept (the newest K)", cmds=RUNNERS)
    eval_data: str | None = _f(None, "held-out data file or store, or 'auto'", cmds=RUNNERS)
    eval_steps: int | None = _f(None, "evaluate every N optimizer steps", cmds=RUNNERS)
    log_steps: int = _f(
        10, "progress/metrics sync every N steps (the only host-device syncs)", cmds=RUNNERS
    )
    report_to: list[str] = _f(["tensorboard"], "tensorboard, wandb or none", cmds=RUNNERS)
    max_bad_steps: int = _f(5, "stop after this many NaN/Inf steps in a row", cmds=RUNNERS)
    resume: bool = _f(
        False, "continue from the newest complete checkpoint in --output", cmds=RUNNERS
    )
    resume_with_changes: bool = _f(
        False,
        "with --resume: continue although settings that change the math differ (both "
        "configurations are kept in --output)",
        cmds=RUNNERS,
    )
    overwrite: bool = _f(False, "replace an existing run in --output", cmds=RUNNERS)
    remeasure: bool = _f(
        False,
        "measure the measured choices (batching: auto) again instead of reusing the cached ones",
        cmds=RUNNERS,
    )
    save_dtype: Literal["auto", "bf16", "fp16", "fp32"] = _f(
        "auto",
        "dtype of the final full fine-tuned model (auto: the base model's; checkpoints stay fp32)",
        cmds=RUNNERS,
    )
    merge_lora: bool = _f(
        False,
        "also write merged/: the LoRA adapter merged into the base, a plain HF model",
        cmds=RUNNERS,
    )

    def to_dict(self) -> dict[str, Any]:
        # A layout set as its member (Layout.PACK) is written as its name: YAML's safe
        # dumper refuses enum members, and configs on disk hold plain strings.
        values = dataclasses.asdict(self)
        return {k: v.value if isinstance(v, Layout) else v for k, v in values.items()}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def saved_yaml(self) -> str:
        """What OUT/config.yaml holds, and `--config OUT/config.yaml --resume` reads back:
        the run, not this start of it (so the start-up flags are written false)."""
        off = {"resume": False, "overwrite": False, "resume_with_changes": False}
        return RunConfig(**{**self.to_dict(), **off}).to_yaml()


FIELDS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(RunConfig)}
_HINTS = typing.get_type_hints(RunConfig)


def field_type(name: str) -> Any:
    return _HINTS[name]


def unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def describe_type(name: str) -> str:
    tp, optional = unwrap_optional(field_type(name))
    if typing.get_origin(tp) is Literal:
        desc = "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    elif typing.get_origin(tp) is list:
        desc = "a list of strings"
    else:
        desc = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}[tp]
    return desc + (" (or null)" if optional else "")


_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def coerce(name: str, value: Any, *, from_string: bool = False) -> Any:
    """Convert `value` to the declared type of field `name`; raise ValueError with a reason."""
    tp, optional = unwrap_optional(field_type(name))
    if value is None or (from_string and optional and value in ("none", "null")):
        if optional:
            return None
        raise ValueError(f"must be {describe_type(name)}, not null")
    if typing.get_origin(tp) is Literal:
        choices = typing.get_args(tp)
        if value in choices:
            return value
        close = difflib.get_close_matches(short_repr(value), [str(c) for c in choices], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"is {short_repr(value)}, must be one of {', '.join(map(repr, choices))}{hint}"
        )
    if typing.get_origin(tp) is list:
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return list(value)
        raise ValueError(f"must be {describe_type(name)}, got {short_repr(value)}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise ValueError(f"must be true or false, got {short_repr(value)}")
    if tp is int:
        if isinstance(value, bool):
            raise ValueError(f"must be an integer, got {short_repr(value)}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                f = float(value.replace("_", ""))
            except ValueError:
                f = None
            if f is not None and f.is_integer():
                return int(f)
        raise ValueError(f"must be an integer, got {short_repr(value)}")
    if tp is float:
        if isinstance(value, bool):
            raise ValueError(f"must be a number, got {short_repr(value)}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ValueError(f"must be a number, got {short_repr(value)}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ValueError(f"must be a string, got {short_repr(value)}")
    raise TypeError(f"unsupported field type for {name}: {tp}")  # a bug, not user error


def _key_hint(key: str) -> str:
    normalized = key.replace("-", "_")
    if normalized in FIELDS:
        return f" (did you mean {normalized!r}?)"
    close = difflib.get_close_matches(normalized, list(FIELDS), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def load_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        what = "is a directory" if p.is_dir() else "does not exist"
        raise ConfigError(f"config file {p} {what}; give the path of a YAML file")
    data = read_yaml(p, str(p))  # bounded: an alias bomb is refused, never expanded
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: must be a mapping of option: value, got {type(data).__name__}")
    return data


def collect_config(
    yaml_values: dict[str, Any] | None = None,
    cli_values: dict[str, Any] | None = None,
    *,
    source: str = "config",
    command: str = TRAIN,
) -> tuple[RunConfig, list[str]]:
    """Merge YAML values, then CLI values (which win), coerce them and check the schema and
    what `command` requires. Returns the config and every problem found (not raised), so
    a command can add the machine's problems (`probe.preflight`) and report all at once."""
    problems: list[str] = []
    values: dict[str, Any] = {}
    for origin, raw, from_string in (
        (source, yaml_values or {}, False),
        ("flag", cli_values or {}, True),
    ):
        for key, val in raw.items():
            if key not in FIELDS:
                problems.append(
                    f"{origin}: unknown option {short_repr(key)}{_key_hint(str(key)[:100])}"
                )
                continue
            try:
                values[key] = coerce(key, val, from_string=from_string and isinstance(val, str))
            except ValueError as e:
                label = f"--{key.replace('_', '-')}" if origin == "flag" else f"{origin}: {key}"
                problems.append(f"{label} {e}")
    cfg = RunConfig(**values)
    for key in ("model", "tokenizer"):  # a Hub id becomes its snapshot in the local Hub cache
        if getattr(cfg, key):
            setattr(cfg, key, resolve_model(getattr(cfg, key)))
    from_file = set(yaml_values or {}) - set(cli_values or {})
    problems += required_problems(cfg, command)
    problems += [_where_given(p, from_file, source) for p in validate(cfg)]
    return cfg, problems


def _where_given(problem: str, from_file: set[str], source: str) -> str:
    """`problem` about the option it starts with ("--lr must be positive"), said of the
    file that gave the value ("run.yaml: lr must be positive") when no flag did."""
    m = re.match(r"--([a-z0-9][a-z0-9-]*)", problem)
    key = m.group(1).replace("-", "_") if m else None
    if m is None or key not in from_file:
        return problem
    return f"{source}: {key}{problem[m.end() :]}"


def build_config(
    yaml_values: dict[str, Any] | None = None,
    cli_values: dict[str, Any] | None = None,
    *,
    source: str = "config",
    command: str = TRAIN,
    extra_problems: list[str] | None = None,
) -> RunConfig:
    """Merge YAML values, then CLI values (which win), coerce and validate everything at once.

    Checks the schema and what `command` needs; the machine's checks (device, precision,
    kernels, strategy) are `pitstop.probe.preflight`, which the commands add."""
    cfg, problems = collect_config(yaml_values, cli_values, source=source, command=command)
    problems = list(extra_problems or []) + problems
    if problems:
        raise ConfigError(problems, header=f"invalid configuration ({len(problems)} problem(s)):")
    return cfg


def parse_betas(text: str) -> tuple[float, float]:
    """ "0.9,0.95" -> (0.9, 0.95); ValueError naming the problem."""
    parts = [p.strip() for p in str(text).split(",")]
    try:
        b1, b2 = (float(p) for p in parts)
    except ValueError:
        raise ValueError(
            f"must be two numbers 'beta1,beta2' such as 0.9,0.95, got {text!r}"
        ) from None
    if not (0 <= b1 < 1 and 0 <= b2 < 1):
        raise ValueError(f"must both be in [0, 1), got {text!r}")
    return b1, b2


# What each command cannot run without; a command not listed (doctor) needs none of them.
REQUIRED: dict[str, tuple[str, ...]] = {
    PREPARE: ("data", "tokenizer"),
    TRAIN: ("data", "model", "output"),
    "profile": ("data", "model"),
    "tune": ("data", "model"),
}


def required_problems(cfg: RunConfig, command: str) -> list[str]:
    """The options `command` needs that `cfg` leaves unset, each with the flag to give."""
    need = REQUIRED.get(command, ())
    p: list[str] = []
    if "data" in need and not cfg.data:
        p.append("no data: give --data FILE (a dataset file or a prepared token store)")
    if "tokenizer" in need and not (cfg.model or cfg.tokenizer):
        p.append("no tokenizer: give --model DIR or --tokenizer DIR")
    if "model" in need and not cfg.model:
        p.append("no model: give --model DIR (a local Hugging Face model directory)")
    if "output" in need and not cfg.output:
        p.append("no output directory: give --output DIR")
    return p


def validate(cfg: RunConfig) -> list[str]:
    """The schema's cross-field checks, every problem at once. What a command requires is
    `required_problems`; what needs the machine is `pitstop.probe.preflight`."""
    return [
        *_count_problems(cfg),
        *_batch_shape_problems(cfg),
        *_schedule_problems(cfg),
        *_run_problems(cfg),
        *_method_problems(cfg),
        *range_problems(cfg),
    ]


# Counts that must be positive (a loader's workers may be 0: the main process loads).
_POSITIVE_COUNTS = (
    "micro_batch_size",
    "grad_accum",
    "tokens_per_step",
    "tokens_per_micro_batch",
    "max_steps",
    "save_steps",
    "eval_steps",
    "lora_r",
    "loader_workers",
)


def _count_problems(cfg: RunConfig) -> list[str]:
    """Lengths and counts: the row length, the workers, every positive count, the epochs."""
    p: list[str] = []
    if cfg.max_seq_len < 8:
        p.append(f"--max-seq-len is {cfg.max_seq_len}; it must be at least 8")
    if cfg.workers < 0:
        p.append("--workers must be 0 (one per core) or more")
    for name in _POSITIVE_COUNTS:
        v = getattr(cfg, name)
        if v is not None and (v < 0 or (v == 0 and name != "loader_workers")):
            least = "0 (the main process loads) or more" if name == "loader_workers" else "positive"
            p.append(f"--{name.replace('_', '-')} must be {least}, got {v}")
    if cfg.epochs is not None and cfg.epochs <= 0:
        p.append(f"--epochs must be positive, got {cfg.epochs}")
    if cfg.epochs is not None and cfg.max_steps is not None:
        p.append("give --epochs or --max-steps, not both")
    return p


def _batch_shape_problems(cfg: RunConfig) -> list[str]:
    """The batch shape: one way to give each size, and a full row in each."""
    p: list[str] = []
    if cfg.tokens_per_step is not None and cfg.grad_accum is not None:
        p.append(
            "give --tokens-per-step or --grad-accum, not both (tokens per step fixes the accumulation)"
        )
    if cfg.micro_batch_size is not None and cfg.tokens_per_micro_batch is not None:
        p.append("give --micro-batch-size (rows) or --tokens-per-micro-batch, not both")
    if cfg.tokens_per_micro_batch is not None and cfg.tokens_per_micro_batch < cfg.max_seq_len:
        p.append(
            f"--tokens-per-micro-batch {cfg.tokens_per_micro_batch} is below --max-seq-len "
            f"{cfg.max_seq_len}: one full row must fit in a micro-batch"
        )
    if cfg.tokens_per_step is not None and cfg.tokens_per_step < cfg.max_seq_len:
        p.append(
            f"--tokens-per-step {cfg.tokens_per_step} is below --max-seq-len {cfg.max_seq_len}: "
            "one full row must fit in an optimizer step"
        )
    layout = Layout.lookup(cfg.batching)  # None for auto
    whole_rows = layout is not None and layout.step_in_whole_rows
    if whole_rows and cfg.tokens_per_step is not None and cfg.tokens_per_step % cfg.max_seq_len:
        p.append(
            f"--tokens-per-step {cfg.tokens_per_step} is not a whole number of packed rows of "
            f"{cfg.max_seq_len} tokens; use a multiple of --max-seq-len"
        )
    return p


def _schedule_problems(cfg: RunConfig) -> list[str]:
    """The learning rate, its floor and gradient clipping."""
    p: list[str] = []
    if cfg.lr <= 0:
        p.append(f"--lr must be positive, got {cfg.lr}")
    if not 0 <= cfg.min_lr_ratio <= 1:
        p.append(f"--min-lr-ratio must be between 0 and 1, got {cfg.min_lr_ratio}")
    if cfg.max_record_seconds < 0:
        p.append("--max-record-seconds must be 0 (no limit) or positive")
    if cfg.max_grad_norm < 0:
        p.append("--max-grad-norm must be 0 (off) or positive")
    return p


def _run_problems(cfg: RunConfig) -> list[str]:
    """The run around the steps: saves, evaluation, logging, resuming, processes, reporters."""
    p: list[str] = []
    if cfg.save_total_limit < 1:
        p.append("--save-total-limit must be at least 1")
    if cfg.save_minutes is not None and cfg.save_minutes <= 0:
        p.append("--save-minutes must be positive")
    if cfg.eval_steps is not None and not cfg.eval_data:
        p.append("--eval-steps needs --eval-data FILE_OR_STORE (or --eval-data auto)")
    if cfg.log_steps < 1:
        p.append("--log-steps must be at least 1")
    if cfg.max_bad_steps < 1:
        p.append("--max-bad-steps must be at least 1")
    if cfg.resume and cfg.overwrite:
        p.append("give --resume or --overwrite, not both")
    if cfg.resume_with_changes and not cfg.resume:
        p.append("--resume-with-changes goes with --resume")
    if cfg.resume and cfg.remeasure:
        p.append(
            "give --resume or --remeasure, not both: a resumed run keeps the choices it started "
            "with (so it continues the same math); start a new run to measure again"
        )
    if cfg.nproc < 1:
        p.append("--nproc must be at least 1")
    # A record field named "" matches no record: every record would be refused later,
    # with the empty name in the message (the optional input field is merely absent).
    for name in [f for f in FIELDS if f.endswith("_field") and getattr(cfg, f) == ""]:
        if name != "input_field":
            flag, default = name.replace("_", "-"), FIELDS[name].default
            p.append(f"--{flag} is empty; give a record field's name (default: {default})")
    bad_reporters = [r for r in cfg.report_to if r not in ("tensorboard", "wandb", "none")]
    if bad_reporters:
        p.append(f"--report-to {','.join(bad_reporters)}: choose from tensorboard, wandb, none")
    return p


def _method_problems(cfg: RunConfig) -> list[str]:
    """How the model is trained: the LoRA options, the optimizer's betas, the template."""
    p: list[str] = []
    if cfg.lora_r is None and (cfg.lora_alpha is not None or cfg.lora_target_modules):
        p.append("LoRA options were given without --lora-r; add --lora-r R")
    try:
        parse_betas(cfg.adam_betas)
    except ValueError as e:
        p.append(f"--adam-betas {e}")
    if cfg.merge_lora and cfg.lora_r is None:
        p.append("--merge-lora merges a LoRA adapter into its base; add --lora-r R")
    if cfg.load_in_4bit and cfg.lora_r is None:
        p.append("--load-in-4bit trains a LoRA adapter on frozen 4-bit weights; add --lora-r R")
    if cfg.template != "alpaca" and "{instruction}" not in cfg.template:
        p.append("--template must be 'alpaca' or contain {instruction} (and optionally {input})")
    return p
