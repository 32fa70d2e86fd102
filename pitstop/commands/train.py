"""`pitstop train`: the optimized training run (`--resume` continues exactly).

At the end of a completed run the command also writes OUT_DIR/report.html (what
`pitstop report OUT_DIR` writes); `pitstop.train.fit(cfg)` from Python trains only.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from pitstop.commands.flags import add_config_flags, config_from_args
from pitstop.core import log, run_record
from pitstop.core.errors import PitstopError
from pitstop.report.html import write_report
from pitstop.train import fit


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `train` subcommand to an argparse subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "train", allow_abbrev=False, help="the optimized training run (--resume continues exactly)"
    )
    add_config_flags(p, "train")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args, "train")
    fit(cfg)
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 alone writes
        _write_report(cfg.output)
    return 0


def _write_report(output: str | None) -> None:
    """The run itself is done, so a report that cannot be written is a warning, never a
    failed run."""
    try:
        path = write_report(output, Path(str(output)) / run_record.REPORT)
    except (OSError, PitstopError) as e:
        log.warning(f"pitstop: report.html not written ({e}); run `pitstop report {output}`")
        return
    log.info(f"pitstop: report written to {path}")
