"""`pitstop compare`: before/after table of two run directories."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pitstop.commands.flags import check_number_flags
from pitstop.report.compare import compare, format_compare


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `compare` subcommand to an argparse subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "compare",
        allow_abbrev=False,
        help="before/after table of two runs",
        description="Compare two run directories on steady per-step medians, with a noise band "
        "on every timing ratio (docs/compare.md).",
    )
    p.add_argument("run_a", metavar="RUN_A")
    p.add_argument("run_b", metavar="RUN_B")
    p.add_argument("--price-per-gpu-hour", metavar="P", help="price for the cost row")
    p.add_argument(
        "--rerun",
        metavar="N",
        help="settle a close call: run the two runs' commands again alternately, A B A B, "
        "N times each, and say what every pair supports (runs made by `pitstop profile -- "
        "COMMAND`; see docs/compare.md)",
    )
    p.add_argument(
        "--rerun-output", metavar="DIR", help="where the reruns go (default: beside RUN_A)"
    )
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--markdown", action="store_true", help="print a Markdown table")
    fmt.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    check_number_flags(args, "compare")
    price = args.price_per_gpu_hour
    result = compare(args.run_a, args.run_b, price)
    settled = None
    if args.rerun is not None:
        # Deferred: reruns launch the recorded commands (pitstop.anyloop loads torch).
        from pitstop.anyloop.rerun import format_settle, rerun_pairs, settle

        settled = settle(rerun_pairs(args.run_a, args.run_b, args.rerun, args.rerun_output))
        result["rerun"] = settled
    if args.json:
        print(json.dumps(result, indent=1, default=str))
    else:
        print(format_compare(result, markdown=args.markdown))
        if settled is not None:
            print("\n" + format_settle(settled))
    return 0
