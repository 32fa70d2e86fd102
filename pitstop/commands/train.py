"""`pitstop train`: the optimized training run (`--resume` continues exactly)."""

from __future__ import annotations

import argparse
from typing import Any

from pitstop.commands.flags import add_config_flags, config_from_args
from pitstop.train import run as train_run


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `train` subcommand to an argparse subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "train", allow_abbrev=False, help="the optimized training run (--resume continues exactly)"
    )
    add_config_flags(p, "train")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    train_run(config_from_args(args, "train"))
    return 0
