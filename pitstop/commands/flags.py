"""The training flags every runner command shares, generated from `pitstop.core.config.RunConfig`.

Every YAML key has a flag of the same name (`max_seq_len` <-> `--max-seq-len`) and the
same validation. `config_from_args` turns parsed flags into a RunConfig and reports
every problem at once: the schema's (`config.validate`), what the command requires,
and what this machine cannot do (`probe.preflight`), in one ConfigError (exit 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
import typing
from typing import Any

from pitstop.core.config import (
    FIELDS,
    RUNNERS,
    TRAIN,
    RunConfig,
    collect_config,
    field_type,
    load_yaml,
    unwrap_optional,
)
from pitstop.core.config_ranges import flag_problems
from pitstop.core.errors import ConfigError
from pitstop.probe import DeviceInfo, config_file_problem, output_dir_problem, preflight

# `--help` shows the flags in these groups, in this order (docs/configuration.md). Every
# RunConfig field is in exactly one group (tests/test_commands.py checks it).
HELP_GROUPS: dict[str, tuple[str, ...]] = {
    "data": (
        "data", "model", "tokenizer", "output", "cache_dir", "format", "split", "text_field",
        "prompt_field", "completion_field", "instruction_field", "input_field", "output_field",
        "messages_field", "template", "max_seq_len", "workers", "on_bad_record",
        "max_record_seconds", "long_docs", "train_on_prompt", "trust_remote_code",
        "recheck_data",
    ),
    "batching": (
        "batching", "tokens_per_step", "micro_batch_size", "tokens_per_micro_batch",
        "grad_accum", "loader_workers", "prefetch_factor", "pin_memory", "remeasure",
    ),
    "optimisation": (
        "epochs", "max_steps", "lr", "min_lr_ratio", "warmup_steps", "schedule",
        "weight_decay", "max_grad_norm", "optimizer", "adam_betas", "seed", "max_bad_steps",
    ),
    "precision and speed": (
        "precision", "attention", "compile", "keep_freed_memory", "gradient_checkpointing",
        "device", "strategy", "nproc",
    ),
    "LoRA and QLoRA": (
        "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "load_in_4bit",
        "merge_lora",
    ),
    "checkpoints and results": (
        "save_steps", "save_minutes", "save_total_limit", "resume", "resume_with_changes",
        "overwrite", "save_dtype",
    ),
    "evaluation and logging": ("eval_data", "eval_steps", "log_steps", "report_to"),
}  # fmt: skip


def add_config_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """One flag per RunConfig field that applies to `command`, in the `HELP_GROUPS` groups;
    only flags given are recorded."""
    parser.add_argument("--config", help="YAML file of options (flags given here win)")
    groups = {title: parser.add_argument_group(f"{title} options") for title in HELP_GROUPS}
    group_of = {name: groups[title] for title, names in HELP_GROUPS.items() for name in names}
    for name, f in FIELDS.items():
        if command not in f.metadata["cmds"]:
            continue
        # A field added without a group still gets its flag (the test names it).
        target: Any = group_of.get(name, parser)
        flag = "--" + name.replace("_", "-")
        tp = field_type(name)
        help_ = f.metadata["help"].replace("%", "%%")
        if name == "data":
            target.add_argument(
                flag, action="append", metavar="FILE", help=help_, default=argparse.SUPPRESS
            )
        elif tp is bool:
            target.add_argument(
                flag, action=argparse.BooleanOptionalAction, help=help_, default=argparse.SUPPRESS
            )
        else:
            inner, _ = unwrap_optional(tp)
            if typing.get_origin(inner) is typing.Literal:
                metavar = "|".join(typing.get_args(inner))
            else:
                metavar = name.split("_")[-1].upper()
            default = f.default if f.default is not dataclasses.MISSING else None
            shown = f"{help_} (default: {default})" if default not in (None, False) else help_

            target.add_argument(flag, metavar=metavar, help=shown, default=argparse.SUPPRESS)


def escape_percent(parser: argparse.ArgumentParser) -> None:
    """Escape a bare '%' in flag help (argparse %-formats help; "5% of the run" breaks --help).

    Already-escaped '%%' and '%(default)s' placeholders are left alone.
    """
    for action in parser._actions:
        if isinstance(action.help, str) and action.help != argparse.SUPPRESS:
            action.help = re.sub(r"(?<!%)%(?![%(])", "%%", action.help)


def unknown_flag_problems(unknown: list[str], command: str) -> list[str]:
    """One problem per flag argparse did not know, with a "did you mean" where one is close."""
    known = ["--" + n.replace("_", "-") for n, f in FIELDS.items() if command in f.metadata["cmds"]]
    problems = []
    after_flag = False
    for tok in unknown:
        if after_flag and not tok.startswith("-"):
            after_flag = False  # the value of the unknown flag just reported
            continue
        after_flag = tok.startswith("--") and "=" not in tok
        if not tok.startswith("--"):
            problems.append(f"unexpected argument {tok!r} (options take the form --name value)")
            continue
        flag = tok.split("=", 1)[0]
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]}?)" if close else f"; see `pitstop {command} --help`"
        problems.append(f"unknown option {flag}{hint}")
    return problems


def config_from_args(
    args: argparse.Namespace, command: str, *, device: DeviceInfo | None = None
) -> RunConfig:
    """The RunConfig the flags (and --config YAML) describe, checked for `command` on this
    machine. Every problem (unknown flags, values, the schema, what the command needs,
    what the machine cannot do) is raised at once, as one ConfigError (exit 2)."""
    given = {k: v for k, v in vars(args).items() if k in FIELDS}
    path = getattr(args, "config", None)
    cfg, problems = collect_config(
        load_yaml(path) if path else {}, given, source=path or "config", command=command
    )
    problems = unknown_flag_problems(getattr(args, "unknown", []), command) + problems
    if command in RUNNERS:  # prepare runs no model: the machine's checks do not apply
        problems += preflight(cfg, device)
    if command == TRAIN:
        out = output_dir_problem(cfg.output, resume=cfg.resume, overwrite=cfg.overwrite)
        own = config_file_problem(path, cfg)  # the run must never remove or rewrite it
        problems += [p for p in (out, own) if p]
    if problems:
        raise ConfigError(problems, header=f"invalid configuration ({len(problems)} problem(s)):")
    return cfg


def check_number_flags(args: argparse.Namespace, command: str) -> None:
    """Every numeric flag of `command` outside RunConfig, checked against its range in
    `pitstop.core.config_ranges.FLAG_RANGES` and replaced by its number; a ConfigError (exit 2)
    names each invalid one, its value, the range and what to give."""
    problems = flag_problems(args, command)
    if problems:
        header = f"invalid options ({len(problems)} problem(s)):" if len(problems) > 1 else None
        raise ConfigError(problems, header=header)


def training_flags_given(args: argparse.Namespace, what: str) -> list[str]:
    """The problem with pitstop training flags (or --config) given beside `-- COMMAND`, which
    brings its own settings ([] when none is); `what` names the command ("a tuned command")."""
    given = sorted(k for k in vars(args) if k in FIELDS) + (["config"] if args.config else [])
    if not given:
        return []
    flags = ", ".join("--" + k.replace("_", "-") for k in given)
    return [
        f"{flags}: training flags configure a pitstop run; {what} brings its own settings "
        "(give them to the command after --)"
    ]
