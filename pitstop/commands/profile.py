"""`pitstop profile`: the command layer over `pitstop.profiling.run_profile`, and over
`pitstop.anyloop.launch` for any training command.

Two forms:

- `pitstop profile [training flags] [--steps K] [--warmup W] [--output PROFILE_JSON]` runs
  K steps of a pitstop config. It takes every training flag
  (`add_config_flags(p, "profile")`), plus --steps, --warmup, --trace and --output.
- `pitstop profile [--output RUN_DIR] [--warmup W] -- python train.py ARGS...` runs any
  command unchanged with the step timer attached; --output is then the run directory it
  writes (default runs/<script>-<UTC time>), and no training flag applies.

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

from pitstop.commands.flags import (
    add_config_flags,
    check_number_flags,
    config_from_args,
    escape_percent,
)
from pitstop.commands.paths import check_outputs
from pitstop.core import log
from pitstop.core.atomic import write_json_atomic
from pitstop.core.errors import ConfigError
from pitstop.core.run_record import PROFILE

DEFAULT_STEPS = 20
DEFAULT_WARMUP = 3
# A script's loop is measured whole (no separate warm-up phase to run), so only its first
# step (allocator, lazy init, worker start) is left out by default.
DEFAULT_SCRIPT_WARMUP = 1


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `profile` subcommand to an argparse subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "profile",
        allow_abbrev=False,
        conflict_handler="resolve",
        help="step-time breakdown and bottleneck verdict: a few steps of a config, or any "
        "training command after --",
        description=(
            "Run W warm-up + K optimizer steps of a training config through the real trainer "
            "(in a temporary directory), then print seconds and share per phase, tokens/s, the "
            "step-time spread, MFU, peak memory, device utilisation and the bottleneck verdict "
            "with its evidence, and write profile.json (schema pitstop.profile/1, warm-up steps "
            "left out) for `pitstop doctor --profile`. Or, after `--`, run any training "
            "command unchanged with the step timer attached (docs/profile-any-loop.md)."
        ),
    )
    add_config_flags(p, "profile")
    escape_percent(p)
    p.add_argument(
        "--steps",
        default=DEFAULT_STEPS,
        help=f"measured steps K (default: {DEFAULT_STEPS})",
    )
    p.add_argument(
        "--warmup",
        default=None,
        help=f"steps run first and left out (compile, allocator warm-up; default: {DEFAULT_WARMUP}, "
        f"with `-- COMMAND` {DEFAULT_SCRIPT_WARMUP})",
    )
    p.add_argument(
        "--output",
        dest="profile_output",
        metavar="PROFILE_JSON",
        default=None,
        help="where to write the profile (default: profile.json); the run itself is not kept. "
        "With `-- COMMAND`: the run directory to write",
    )
    p.add_argument(
        "--trace",
        metavar="DIR",
        help="also write a torch.profiler Chrome trace of the first measured steps to DIR "
        "(open in ui.perfetto.dev or chrome://tracing; profiling slows those steps)",
    )
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    p.add_argument(
        "script_command",
        nargs=argparse.REMAINDER,
        metavar="-- COMMAND ...",
        help="profile this training command instead of a config, unchanged (e.g. "
        "`-- python train.py --lr 3e-4`, or `-- torchrun --nproc-per-node 2 train.py`): "
        "--output is then the run directory (default runs/<script>-<UTC time>); "
        "see docs/profile-any-loop.md",
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    check_number_flags(args, "profile")
    # Deferred: the profile runs the trainer (torch), which `pitstop --help` must not load.
    from pitstop.profiling import format_profile, run_profile

    rest = list(args.script_command or [])
    if rest and rest[0] == "--":
        return run_script(args, rest[1:])
    # Without `--`, words argparse left over belong to the config form's flags (e.g. the
    # value of a misspelt flag): reported with the configuration's problems.
    args.unknown = list(getattr(args, "unknown", None) or []) + rest
    if rest and not rest[0].startswith("-"):
        log.warning(
            f"pitstop profile: to profile a command, put it after --: "
            f"`pitstop profile -- {' '.join(rest)}`"
        )
    if args.warmup is None:
        args.warmup = DEFAULT_WARMUP
    problems = check_outputs(
        files={"--output": (args.profile_output, PROFILE)}, dirs={"--trace": args.trace}
    )
    cfg = config_from_args(args, "profile")  # raises every config problem at once
    if problems:
        raise ConfigError(problems, header=f"invalid options ({len(problems)} problem(s)):")
    result = run_profile(cfg, steps=args.steps, warmup=args.warmup, trace_dir=args.trace)
    out = Path(args.profile_output or PROFILE)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out, result.profile)  # never a half-written profile at the path
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


def run_script(args: argparse.Namespace, command: list[str]) -> int:
    """`pitstop profile -- COMMAND`: run it with the timer attached, print what it measured."""
    from pitstop.commands.flags import training_flags_given

    problems = training_flags_given(args, "a profiled command")
    if args.steps != DEFAULT_STEPS:
        problems.append("--steps: a profiled command runs its own number of steps")
    if args.trace:
        problems.append("--trace: not available for a profiled command yet")
    if args.unknown:
        problems.append(f"unrecognized arguments before --: {' '.join(args.unknown)}")
    warmup = DEFAULT_SCRIPT_WARMUP if args.warmup is None else args.warmup
    problems += check_outputs(dirs={"--output": args.profile_output})  # a run directory here
    if problems:
        raise ConfigError(problems, header=f"invalid options ({len(problems)} problem(s)):")
    # Deferred: the launcher's module loads torch and transformers.
    from pitstop.anyloop.launch import (
        check_command,
        default_output,
        format_results,
        load_results,
        run_command,
    )

    out = Path(args.profile_output) if args.profile_output else default_output(command)
    check_command(command, out)
    rc = run_command(command, out, warmup_steps=warmup)
    if rc != 0:
        log.warning(f"pitstop profile: the command exited with status {rc}")
    profile, report = load_results(out)
    if args.json:
        print(json.dumps(profile, indent=1, default=str))
    else:
        print(format_results(profile, report))
        print(
            f"\nrun written to {out} (pitstop compare / report {out}; "
            f"pitstop doctor --profile {out})"
        )
    return rc
