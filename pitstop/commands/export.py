"""`pitstop export RUN --merge`: a LoRA run's adapter merged into a plain HF model."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pitstop.commands.paths import require_outputs
from pitstop.errors import ConfigError


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `export` subcommand to an argparse subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "export", allow_abbrev=False, help="a LoRA run's adapter merged into a plain HF model"
    )
    p.add_argument("run", help="run directory (its final/ adapter) or an adapter directory")
    p.add_argument("--merge", action="store_true", help="merge the LoRA adapter into its base")
    p.add_argument("--output", help="where to write (default: RUN/merged)")
    p.add_argument(
        "--dtype",
        choices=("auto", "bf16", "fp16", "fp32"),
        default="auto",
        help="dtype of the merged weights (default auto: the base model's)",
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    if not args.merge:
        raise ConfigError(
            "pitstop export writes a merged model: pass --merge (a full fine-tune's final/ "
            "already is a plain Hugging Face model directory)"
        )
    require_outputs(dirs={"--output": args.output})
    from pitstop.train.export import merge_adapter  # imports torch and transformers

    dest = merge_adapter(Path(args.run), Path(args.output) if args.output else None, args.dtype)
    print(f"merged model: {dest}")
    return 0
