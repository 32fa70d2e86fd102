"""The `pitstop` command: a thin layer that parses flags and calls the library.

Flags are generated from `pitstop.config.RunConfig`, so every YAML key has a flag
of the same name (`max_seq_len` ↔ `--max-seq-len`) and the same validation.
User errors (`PitstopError`) are printed without a traceback and exit with their
code (2 for configuration, 1 for data).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import sys
import typing
from collections.abc import Callable, Sequence
from pathlib import Path

from pitstop import __version__
from pitstop.config import FIELDS, RunConfig, build_config, field_type, load_yaml, unwrap_optional
from pitstop.errors import ConfigError, PitstopError


def _add_config_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """One flag per RunConfig field that applies to `command`; only flags given are recorded."""
    parser.add_argument("--config", help="YAML file of options (flags given here win)")
    for name, f in FIELDS.items():
        if command not in f.metadata["cmds"]:
            continue
        flag = "--" + name.replace("_", "-")
        tp = field_type(name)
        help_ = f.metadata["help"].replace("%", "%%")
        if name == "data":
            parser.add_argument(
                flag, action="append", metavar="FILE", help=help_, default=argparse.SUPPRESS
            )
        elif tp is bool:
            parser.add_argument(
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

            parser.add_argument(flag, metavar=metavar, help=shown, default=argparse.SUPPRESS)


def _unknown_flag_problems(unknown: list[str], command: str) -> list[str]:
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


def _config_from_args(args: argparse.Namespace, command: str) -> RunConfig:
    given = {k: v for k, v in vars(args).items() if k in FIELDS}
    yaml_values = load_yaml(args.config) if getattr(args, "config", None) else {}
    return build_config(
        yaml_values,
        given,
        source=getattr(args, "config", None) or "config",
        command=command,
        extra_problems=_unknown_flag_problems(getattr(args, "unknown", []), command),
    )


def cmd_prepare(args: argparse.Namespace) -> int:
    cfg = _config_from_args(args, "prepare")
    from pitstop.data.prepare import format_stats, prepare_data

    result = prepare_data(cfg, progress=not args.json)
    if args.json:
        print(
            json.dumps(
                {"store": str(result.store_path), "cache_hit": result.cache_hit, **result.stats},
                indent=1,
            )
        )
    else:
        print(format_stats(result.stats))
        hit = "cache hit" if result.cache_hit else f"prepared in {result.seconds:.1f} s"
        print(f"\ntoken store: {result.store_path} ({hit})")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    cfg = _config_from_args(args, "train")
    from pitstop.train import run

    run(cfg)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from pitstop.demo import run_demo

    return run_demo(output=args.output, max_steps=args.max_steps)


def cmd_export(args: argparse.Namespace) -> int:
    if not args.merge:
        raise ConfigError(
            "pitstop export writes a merged model: pass --merge (a full fine-tune's final/ "
            "already is a plain Hugging Face model directory)"
        )
    from pitstop.train.export import merge_adapter

    dest = merge_adapter(Path(args.run), Path(args.output) if args.output else None, args.dtype)
    print(f"merged model: {dest}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pitstop",
        allow_abbrev=False,
        description="Fast, cheap and explainable LLM training runs.",
    )
    parser.add_argument("--version", action="version", version=f"pitstop {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser(
        "prepare",
        allow_abbrev=False,
        help="dataset file(s) -> cached token store, with length statistics",
    )
    _add_config_flags(p, "prepare")
    p.add_argument("--json", action="store_true", help="print the statistics as JSON")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser(
        "train", allow_abbrev=False, help="the optimized training run (--resume continues exactly)"
    )
    _add_config_flags(p, "train")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser(
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
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("demo", help="the embedded default: bundled corpus, tiny model, end to end")
    p.add_argument("--output", default="demo-out", help="where the demo writes (default: demo-out)")
    p.add_argument(
        "--max-steps", type=int, default=80, help="optimizer steps to train (default: 80)"
    )
    p.set_defaults(func=cmd_demo)

    from pitstop.advise.command import register as register_doctor

    register_doctor(sub)

    from pitstop.report.command import register as register_report

    register_report(sub)

    from pitstop.measure.profile_command import register as register_profile
    from pitstop.tune.command import register as register_tune

    register_profile(sub)
    register_tune(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and args.command not in ("prepare", "train", "profile", "tune"):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.unknown = unknown
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except PitstopError as e:
        # Under torchrun every rank raises the same error; rank 0 says it once.
        if os.environ.get("RANK", "0") == "0":
            print(f"pitstop {args.command}: error: {e.render()}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"pitstop {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
