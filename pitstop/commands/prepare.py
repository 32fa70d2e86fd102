"""`pitstop prepare`: dataset file(s) -> cached token store, with length statistics."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pitstop.commands.flags import add_config_flags, config_from_args


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `prepare` subcommand to an argparse subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "prepare",
        allow_abbrev=False,
        help="dataset file(s) -> cached token store, with length statistics",
    )
    add_config_flags(p, "prepare")
    p.add_argument("--json", action="store_true", help="print the statistics as JSON")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args, "prepare")
    # Deferred: preparing loads tokenizers (transformers), which `pitstop --help` must not.
    from pitstop.core import log
    from pitstop.core.stopping import stop_on_signals
    from pitstop.data.prepare import format_stats, prepare_data
    from pitstop.data.stats import eos_only_message, slow_records_message

    # SIGTERM too ends through prepare's cleanup: the partial store removed, the tokenizer
    # workers stopped (Python's default would end the process around both).
    with stop_on_signals("the prepare", "nothing was published to the cache; run it again"):
        result = prepare_data(cfg, progress=not args.json)
    if args.json:
        print(
            json.dumps(
                {"store": str(result.store_path), "cache_hit": result.cache_hit, **result.stats},
                indent=1,
            )
        )
    else:
        print(format_stats(result.stats))
        hit = "cache hit" if result.cache_hit else f"prepared in {result.seconds:.1f} s"
        print(f"\ntoken store: {result.store_path} ({hit})")
    # After the table, so they are the last thing read; a store from before a count has none.
    slow = slow_records_message(result.stats)
    if slow:
        log.warning(f"pitstop: warning: {slow}")
    info = result.stats.get("eos_only_documents")
    warning = eos_only_message(info, result.stats)
    if warning:
        refused = "; `pitstop train` refuses it" if info["count"] == info["of"] else ""
        log.warning(f"pitstop: warning: {warning}{refused}")
    return 0
