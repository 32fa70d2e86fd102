"""`pitstop report`: a self-contained HTML report with plots of one or more runs."""

from __future__ import annotations

import argparse
from typing import Any

from pitstop.commands.flags import check_number_flags
from pitstop.commands.paths import require_outputs
from pitstop.report.html import write_report


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `report` subcommand to an argparse subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "report",
        allow_abbrev=False,
        help="self-contained HTML report with plots of one or more runs",
    )
    p.add_argument("runs", metavar="RUN_DIR", nargs="+")
    p.add_argument(
        "--output",
        metavar="FILE",
        default="report.html",
        help="HTML file to write (default: report.html)",
    )
    p.add_argument("--price-per-gpu-hour", metavar="P", help="price for the cost section")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    check_number_flags(args, "report")
    price = args.price_per_gpu_hour
    require_outputs(files={"--output": (args.output, "report.html")})
    out = write_report(args.runs, args.output, price=price)
    print(f"report written to {out}")
    return 0
