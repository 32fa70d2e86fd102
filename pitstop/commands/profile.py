"""`pitstop profile`: the command layer over `pitstop.profiling.run_profile`.

The command takes every training flag (`add_config_flags(p, "profile")`), plus
--steps, --warmup, --trace and --output.

`--output` here is the profile JSON path, not a run directory: a profile never keeps
its run (the steps run in a temporary directory that is removed), so the RunConfig
field `output` has nothing to name. The parser is built with
`conflict_handler="resolve"` so this command's --output replaces the config flag.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pitstop import log
from pitstop.commands.flags import add_config_flags, config_from_args, escape_percent
from pitstop.commands.paths import check_outputs
from pitstop.errors import ConfigError

DEFAULT_STEPS = 20
DEFAULT_WARMUP = 3


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `profile` subcommand to an argparse subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "profile",
        allow_abbrev=False,
        conflict_handler="resolve",
        help="run a few steps of a config: step-time breakdown and bottleneck verdict",
        description=(
            "Run W warm-up + K optimizer steps of a training config through the real trainer "
            "(in a temporary directory), then print seconds and share per phase, tokens/s, the "
            "step-time spread, MFU, peak memory, device utilisation and the bottleneck verdict "
            "with its evidence, and write profile.json (schema pitstop.profile/1, warm-up steps "
            "left out) for `pitstop doctor --profile`."
        ),
    )
    add_config_flags(p, "profile")
    escape_percent(p)
    p.add_argument(
        "--steps",
        type=int,
        default=DEFAULT_STEPS,
        help=f"measured steps K (default: {DEFAULT_STEPS})",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=DEFAULT_WARMUP,
        help=f"steps run first and left out (compile, allocator warm-up; default: {DEFAULT_WARMUP})",
    )
    p.add_argument(
        "--output",
        dest="profile_output",
        metavar="PROFILE_JSON",
        default="profile.json",
        help="where to write the profile (default: profile.json); the run itself is not kept",
    )
    p.add_argument(
        "--trace",
        metavar="DIR",
        help="also write a torch.profiler Chrome trace of the first measured steps to DIR "
        "(open in ui.perfetto.dev or chrome://tracing; profiling slows those steps)",
    )
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    # Deferred: the profile runs the trainer (torch), which `pitstop --help` must not load.
    from pitstop.profiling import format_profile, run_profile

    problems = []
    if args.steps < 1:
        problems.append(f"--steps must be at least 1, got {args.steps}")
    if args.warmup < 0:
        problems.append(f"--warmup must be 0 or more, got {args.warmup}")
    problems += check_outputs(
        files={"--output": (args.profile_output, "profile.json")}, dirs={"--trace": args.trace}
    )
    cfg = config_from_args(args, "profile")  # raises every config problem at once
    if problems:
        raise ConfigError(problems, header=f"invalid options ({len(problems)} problem(s)):")
    result = run_profile(cfg, steps=args.steps, warmup=args.warmup, trace_dir=args.trace)
    out = Path(args.profile_output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result.profile, indent=1, default=str) + "\n", encoding="utf-8")
    if args.json:
        print(json.dumps(result.profile, indent=1, default=str))
    else:
        print(format_profile(result.profile))
        print(f"\nprofile written to {out}")
        if result.trace_path is not None:
            print(f"Chrome trace written to {result.trace_path}")
    if result.trace_path is None and args.trace:
        log.warning(f"pitstop profile: warning: no trace was written to {args.trace}")
    return 0
