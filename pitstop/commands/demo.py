"""`pitstop demo`: the embedded default (bundled corpus, tiny model, end to end)."""

from __future__ import annotations

import argparse
from typing import Any

from pitstop.commands.flags import check_number_flags
from pitstop.commands.paths import require_outputs
from pitstop.demo import run_demo


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `demo` subcommand to an argparse subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "demo", help="the embedded default: bundled corpus, tiny model, end to end"
    )
    p.add_argument("--output", default="demo-out", help="where the demo writes (default: demo-out)")
    p.add_argument("--max-steps", default=80, help="optimizer steps to train (default: 80)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    check_number_flags(args, "demo")
    require_outputs(dirs={"--output": args.output})
    return run_demo(output=args.output, max_steps=args.max_steps)
