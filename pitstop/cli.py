"""The `pitstop` command: a registry of the commands in `pitstop.commands`.

Each command module adds its subcommand (`register`) and runs it (`run`). User errors
(`PitstopError`) are printed without a traceback and exit with their code (2 for
configuration, 1 for data).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from pitstop.commands import (
    compare,
    demo,
    doctor,
    estimate,
    export,
    prepare,
    profile,
    report,
    train,
    tune,
)
from pitstop.core import log
from pitstop.core.errors import PitstopError
from pitstop.core.version import __version__
from pitstop.fs_errors import command_file_errors

# In `pitstop --help` order.
COMMANDS = (prepare, train, export, demo, doctor, estimate, compare, report, profile, tune)
# Commands that take the RunConfig flags: an unknown flag there is reported with the
# configuration's other problems (with "did you mean"), not by argparse alone.
CONFIG_COMMANDS = ("prepare", "train", "profile", "tune")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pitstop",
        allow_abbrev=False,
        description="Fast, cheap and explainable LLM training runs.",
    )
    parser.add_argument("--version", action="version", version=f"pitstop {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for command in COMMANDS:
        _add_output_flags(command.register(sub))
    return parser


def _add_output_flags(p: argparse.ArgumentParser) -> None:
    """How much every command says on stderr (pitstop/core/log.py); results on stdout are unaffected."""
    g = p.add_argument_group("output options")
    g.add_argument(
        "--log-level",
        choices=log.LEVELS,
        default=None,
        help="messages on stderr from this level up (default: info; $PITSTOP_LOG_LEVEL)",
    )
    g.add_argument(
        "--quiet",
        action="store_true",
        help="only warnings and errors on stderr: no banner, progress or notices",
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and args.command not in CONFIG_COMMANDS:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.unknown = unknown
    func: Callable[[argparse.Namespace], int] = args.func
    before = log.logger.level
    if args.quiet or args.log_level:
        log.set_level("warning" if args.quiet else args.log_level)
    try:
        with command_file_errors(
            args.command, getattr(args, "output", None), getattr(args, "cache_dir", None)
        ):
            return func(args)
    except PitstopError as e:
        # Under torchrun every rank raises the same error; rank 0 says it once.
        if os.environ.get("RANK", "0") == "0":
            print(f"pitstop {args.command}: error: {e.render()}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:  # Ctrl-C, or a command's stop_on_signals (SIGTERM too)
        print(f"pitstop {args.command}: {e or 'interrupted'}", file=sys.stderr)
        return int(getattr(e, "exit_code", 130))
    except BrokenPipeError:
        # The reader went away (`pitstop estimate ... | head`): not an error of ours. Point
        # stdout at devnull so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # what a shell reports for SIGPIPE
    finally:
        log.logger.setLevel(before)  # main() called again in one process starts afresh


def entry() -> None:
    """The process's entry point (the `pitstop` script, `python -m pitstop`): `main`, then exit.

    A torchrun worker (WORLD_SIZE > 1) leaves without the interpreter's teardown once its
    work is flushed. After a distributed run, torch keeps the gloo process group alive
    past `destroy_process_group` (its device meshes stay referenced, its worker threads
    keep running), and tearing those down while the interpreter finalizes sometimes
    aborts the rank ("terminate called without an active exception", SIGABRT): torchrun
    then reports a finished run as failed and SIGTERMs the other ranks, rank 0 included
    while it writes the report. Everything a rank writes is closed or flushed before
    `main` returns; garbage is collected first so loader workers are shut down as usual.
    """
    leave(main())


def leave(rc: int) -> NoReturn:
    """Exit with `rc`; a torchrun worker without the interpreter's teardown (`entry`'s
    docstring says why), once garbage is collected and its streams are flushed."""
    if "torch.distributed" in sys.modules and int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        import gc
        import logging

        gc.collect()
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing to say
                stream.flush()
        os._exit(rc)
    sys.exit(rc)


if __name__ == "__main__":  # pragma: no cover
    entry()
