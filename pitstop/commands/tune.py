"""`pitstop tune`: the command layer over `pitstop.tune.tuner.tune`.

The command takes every training flag (`add_config_flags(p, "tune")`) plus the
tuner's own. `--output` is the tuned YAML path (trials run in temporary directories
and keep nothing), so the parser uses `conflict_handler="resolve"` to let it replace
the config's `--output`; the run directory written into the YAML comes from
`--run-output`, else the config's `output`, else `<yaml stem>-run` next to the YAML.

`pitstop tune [--budget-seconds S] [--steps K] [--output DIR] [--dry-run]
[--allow-batch-changes] -- CMD ...` instead measures the doctor's fixes on any training
command (`pitstop.tune.script.tune_script`); `--output` is then the directory of the trial
runs (default runs/tune-<script>-<UTC time>) and no training flag applies.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
from collections.abc import Iterator
from types import FrameType
from typing import Any

from pitstop.commands.flags import (
    add_config_flags,
    check_number_flags,
    config_from_args,
    escape_percent,
)
from pitstop.commands.paths import check_outputs
from pitstop.core import log
from pitstop.core.errors import ConfigError, PitstopError
from pitstop.core.stopping import on_stop_signals
from pitstop.tune.script import DEFAULT_BUDGET_SECONDS as SCRIPT_BUDGET_SECONDS
from pitstop.tune.search import StopRequest, TuneInterrupted
from pitstop.tune.space import KNOBS
from pitstop.tune.trial import remove_trial_dirs
from pitstop.tune.tuner import DEFAULT_BUDGET_SECONDS, format_report, tune, write_tuned_config


class TuneStopped(PitstopError):
    """SIGINT or SIGTERM stopped the tune; nothing was written but cached trials."""


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    """SIGTERM and SIGINT raise TuneInterrupted wherever the tune is.

    Python's default SIGTERM ended the process at once, leaving the running trial's
    temporary run directory behind; inside a trial, the trainer's own handlers take
    over and the trial turns the stop into TuneInterrupted (tune/trial.py).
    """

    def stop(signum: int, frame: FrameType | None) -> None:
        StopRequest.signum = signum
        # Raised inside a finalizer, the exception is printed ("Exception ignored in")
        # and dropped; the next trial raises it from the flag instead.
        while frame is not None:
            if frame.f_code.co_name == "__del__":
                return
            frame = frame.f_back
        raise TuneInterrupted(signum)

    StopRequest.signum = None
    try:
        with on_stop_signals(stop):
            yield
    finally:
        StopRequest.signum = None


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `tune` subcommand to an argparse subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "tune",
        allow_abbrev=False,
        conflict_handler="resolve",
        help="measured search for the fastest settings with the same tokens per optimizer step",
        description=(
            "Measure the configuration as given, then short trial runs of alternatives "
            "(micro-batch size, batching, torch.compile, attention kernel, loader workers and "
            "prefetch; gradient checkpointing only when nothing fits) by coordinate descent "
            "within a time budget. Tokens per optimizer step stay exactly the same. Prints the "
            "trials, the winner and its speed-up measured in this run, and writes the winning "
            "config as YAML for `pitstop train --config`."
        ),
    )
    add_config_flags(p, "tune")
    escape_percent(p)
    _add_tuner_flags(p)
    _add_script_flags(p)
    p.set_defaults(func=run)
    return p


def _add_tuner_flags(p: argparse.ArgumentParser) -> None:
    """The measured search's own flags: where the tuned config goes, the budget, the
    memory cap, the knobs and how each trial is measured."""
    p.add_argument(
        "--output",
        dest="tuned_output",
        metavar="TUNED_YAML",
        default="tuned.yaml",
        help="where to write the tuned config (default: tuned.yaml)",
    )
    p.add_argument(
        "--run-output",
        metavar="DIR",
        help="the output directory written into the tuned config (default: the config's "
        "output, else <yaml name>-run next to the YAML)",
    )
    p.add_argument(
        "--budget-seconds",
        default=None,
        help=f"time for the whole search (default: {DEFAULT_BUDGET_SECONDS:.0f}; with "
        f"-- COMMAND {SCRIPT_BUDGET_SECONDS:.0f})",
    )
    p.add_argument(
        "--memory-cap-gb",
        help="memory a trial may use (default: the GPU's memory; on CPU 80%% of the RAM "
        "available at start); 10%% headroom is kept under it",
    )
    p.add_argument(
        "--knobs",
        default=",".join(KNOBS),
        help=f"what to tune, comma-separated (default: {','.join(KNOBS)})",
    )
    p.add_argument("--trial-warmup", default=2, help="steps left out of each trial (default: 2)")
    p.add_argument(
        "--trial-steps",
        default=30,
        help="most measured steps per trial; a trial stops earlier once its median step "
        "time is stable to 2%% (default: 30)",
    )
    p.add_argument(
        "--no-trial-cache",
        action="store_true",
        help="measure every trial again instead of reusing an earlier tune's",
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON")


def _add_script_flags(p: argparse.ArgumentParser) -> None:
    """The flags of `pitstop tune -- COMMAND` (tune/script.py), and the command itself."""
    p.add_argument(
        "--steps",
        default=None,
        help="with -- COMMAND: measured optimizer steps per trial (default: 12)",
    )
    p.add_argument(
        "--max-pairs",
        default=None,
        help="with -- COMMAND: baseline/trial pairs per fix at most (default: 3); a verdict "
        "needs 2, so 1 measures each fix once, with its band, and calls none faster",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="with -- COMMAND: print the plan (trials, safety, budget) and run nothing",
    )
    p.add_argument(
        "--allow-batch-changes",
        action="store_true",
        help="with -- COMMAND: include fixes that change which tokens form a step "
        "(group_by_length) in the recommendation",
    )
    p.add_argument(
        "script_command",
        nargs=argparse.REMAINDER,
        metavar="-- COMMAND ...",
        help="measure the doctor's fixes on this training command, unchanged (e.g. "
        "`-- python train.py`): --output is then the trials' directory; see docs/tune.md",
    )


def run(args: argparse.Namespace) -> int:
    rest = list(getattr(args, "script_command", None) or [])
    if rest and rest[0] == "--":
        return run_script(args, rest[1:])
    args.unknown = list(getattr(args, "unknown", None) or []) + rest
    problems = []
    if args.steps is not None:
        problems.append("--steps: only with -- COMMAND (use --trial-steps)")
    if args.dry_run or args.allow_batch_changes:
        problems.append("--dry-run / --allow-batch-changes: only with -- COMMAND")
    if problems:
        raise ConfigError(problems, header=f"invalid options ({len(problems)} problem(s)):")
    if args.budget_seconds is None:
        args.budget_seconds = DEFAULT_BUDGET_SECONDS
    check_number_flags(args, "tune")
    knobs = tuple(k.strip() for k in args.knobs.split(",") if k.strip())
    problems = [
        f"--knobs: unknown knob {k!r}; choose from {', '.join(KNOBS)}"
        for k in knobs
        if k not in KNOBS
    ]
    if not knobs:  # "--knobs ," or "--knobs ''": a search that could change nothing
        problems.append(f"--knobs names no knob; give one or more of {', '.join(KNOBS)}")
    problems += check_outputs(
        files={"--output": (args.tuned_output, "tuned.yaml")},
        dirs={"--run-output": args.run_output},
    )
    cfg = config_from_args(args, "tune")
    if problems:
        raise ConfigError(problems, header=f"invalid options ({len(problems)} problem(s)):")

    def progress(msg: str) -> None:
        log.info(f"pitstop tune: {msg}")

    try:
        with _stop_on_signals():
            report = tune(
                cfg,
                budget_seconds=args.budget_seconds,
                knobs=knobs,
                memory_cap_gb=args.memory_cap_gb,
                trial_warmup=args.trial_warmup,
                trial_steps=args.trial_steps,
                use_cache=not args.no_trial_cache,
                log=progress,
            )
            StopRequest.check()  # a stop whose exception was swallowed on the way
    except TuneInterrupted as e:
        remove_trial_dirs(os.getpid())  # one the signal caught half made or half removed
        name = signal.Signals(e.signum).name
        err = TuneStopped(
            f"{name} stopped the tune: no tuned config was written ({args.tuned_output} is "
            "as it was) and the running trial's temporary directory was removed; the trials "
            "measured so far are cached, so the same command starts again quicker"
        )
        err.exit_code = 128 + e.signum
        raise err from None
    if report.result.best is not None:
        write_tuned_config(cfg, report, args.tuned_output, run_output=args.run_output)
    if args.json:
        print(json.dumps(report.to_json(), indent=1, default=str))
    else:
        print(format_report(report))
        if report.tuned_path is not None:
            print(f"\ntuned config written to {report.tuned_path}; train with:")
            print(f"  pitstop train --config {report.tuned_path}")
    return 0 if report.result.best is not None else 1


def run_script(args: argparse.Namespace, command: list[str]) -> int:
    """`pitstop tune -- COMMAND`: measure the doctor's fixes on the command (tune/script.py)."""
    import time
    from pathlib import Path

    from pitstop.commands.flags import training_flags_given
    from pitstop.tune import script

    problems = training_flags_given(args, "a tuned command")
    if getattr(args, "unknown", None):
        problems.append(f"unrecognized arguments before --: {' '.join(args.unknown)}")
    if not command:
        problems.append(
            "give the training command after --, e.g. `pitstop tune -- python train.py`"
        )
    check_number_flags(args, "tune")  # NaN, infinities, out of range: refused first
    budget = float(args.budget_seconds or SCRIPT_BUDGET_SECONDS)
    steps = int(args.steps or script.DEFAULT_STEPS)
    if steps < 4:
        problems.append("--steps: at least 4 (the noise band needs steady steps)")
    out_given = args.tuned_output if args.tuned_output != "tuned.yaml" else None
    if out_given is None and command:
        name = next((Path(a).stem for a in command[1:] if a.endswith(".py")), Path(command[0]).name)
        out_given = f"runs/tune-{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    if out_given and Path(out_given).exists() and any(Path(out_given).iterdir()):
        problems.append(f"--output: {out_given} is not empty (trials never overwrite runs)")
    if problems:
        raise ConfigError(problems, header=f"invalid options ({len(problems)} problem(s)):")
    out = Path(out_given or "runs/tune")
    if args.dry_run:
        print(
            script.format_dry_run(
                command, out, steps=steps, warmup=script.DEFAULT_WARMUP, budget_seconds=budget
            )
        )
        return 0
    # Deferred: the launcher loads torch and transformers.
    from pitstop.anyloop.launch import check_command

    check_command(command, out)
    report = script.tune_script(
        command,
        out,
        _runner,
        budget_seconds=budget,
        steps=steps,
        allow_batch_changes=args.allow_batch_changes,
        max_pairs=int(args.max_pairs or script.MAX_ROUNDS),
        log=lambda msg: log.info(f"pitstop tune: {msg}"),
    )
    if args.json:
        print(json.dumps(script.report_json(report), indent=1, default=str))
    else:
        print(script.format_script_report(report))
    return 0


def _runner(command: list[str], run_dir: Any, settings: Any, warmup: int, seconds: float) -> int:
    """Run one trial: the launcher with the trial's settings in the boot hook's environment;
    past `seconds` (the budget left) the trial and what it started are stopped."""
    from pitstop.anyloop.launch import run_command
    from pitstop.tune.script_settings import ENV_SETTINGS

    before = os.environ.get(ENV_SETTINGS)
    os.environ[ENV_SETTINGS] = settings.to_json()
    try:
        return run_command(command, run_dir, warmup_steps=warmup, seconds=seconds)
    finally:
        if before is None:
            os.environ.pop(ENV_SETTINGS, None)
        else:
            os.environ[ENV_SETTINGS] = before
