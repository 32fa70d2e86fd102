"""`pitstop compare`: before/after table of two run directories."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pitstop.commands.flags import price_flag
from pitstop.report.compare import compare, format_compare


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `compare` subcommand to an argparse subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "compare",
        allow_abbrev=False,
        help="before/after table of two runs",
        description="Compare two run directories.",
    )
    p.add_argument("run_a", metavar="RUN_A")
    p.add_argument("run_b", metavar="RUN_B")
    p.add_argument("--price-per-gpu-hour", metavar="P", help="price for the cost row")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--markdown", action="store_true", help="print a Markdown table")
    fmt.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    price = price_flag(args)
    result = compare(args.run_a, args.run_b, price)
    if args.json:
        print(json.dumps(result, indent=1, default=str))
    else:
        print(format_compare(result, markdown=args.markdown))
    return 0
