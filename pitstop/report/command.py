"""The `estimate`, `compare` and `report` subcommands: flags, validation, printing.

`pitstop.cli` calls `register(subparsers)`; each handler returns an exit code and
raises ConfigError (exit 2) for bad flags and DataError (exit 1) for unreadable inputs.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from pitstop.errors import ConfigError

PRECISIONS = ("bf16", "fp16", "fp32")


def _float(s: str) -> float:
    return float(s.replace("_", ""))


def register(subparsers: Any) -> None:
    """Add `estimate`, `compare` and `report` to the CLI's subparsers."""
    p = subparsers.add_parser(
        "estimate",
        allow_abbrev=False,
        help="memory, time and cost of a planned run (measured or from FLOPs and a GPU)",
        description="Memory per part, time and cost of a planned run, each with its basis.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--model", metavar="DIR", help="Hugging Face model directory (config.json is read)"
    )
    src.add_argument(
        "--params", metavar="N", help="parameter count for a rough Llama-shaped guess (e.g. 7e9)"
    )
    p.add_argument(
        "--data",
        metavar="FILE_OR_STORE",
        help="dataset file (prepared with --model's tokenizer) or token store",
    )
    p.add_argument("--tokens", metavar="T", help="tokens per epoch (instead of --data)")
    p.add_argument("--epochs", metavar="E", default="1", help="passes over the data (default: 1)")
    p.add_argument(
        "--max-seq-len", metavar="L", help="row length (default: the store's, else 1024)"
    )
    p.add_argument(
        "--from-profile",
        metavar="PROFILE",
        help="profile.json, summary.json or a run directory: measured throughput",
    )
    p.add_argument(
        "--gpu", metavar="NAME", help="GPU to estimate for (e.g. H100, 'A100 80GB', 'RTX 4090')"
    )
    p.add_argument(
        "--gpu-tflops",
        metavar="T",
        help="your GPU's dense peak TFLOP/s at the run's precision (replaces the table's)",
    )
    p.add_argument("--gpu-memory-gib", metavar="M", help="your GPU's memory in GiB")
    p.add_argument(
        "--optimizer",
        choices=("adamw", "adamw_8bit", "paged_adamw_8bit"),
        default="adamw",
        help="optimizer whose states to count (8-bit AdamW: ~2 B per parameter instead of 8)",
    )
    p.add_argument("--mfu", metavar="X", help="model FLOPs utilisation to assume (0-1)")
    p.add_argument(
        "--gpus",
        metavar="LIST",
        default="1,2,4,8",
        help="GPU counts for the options table (default: 1,2,4,8)",
    )
    p.add_argument(
        "--scaling-efficiency",
        metavar="E",
        default=None,
        help="fraction of linear speed-up kept per doubling of GPUs (default: 0.9, assumed)",
    )
    p.add_argument(
        "--price-per-gpu-hour", metavar="P", help="your price (default: an example price for --gpu)"
    )
    p.add_argument("--lora-r", metavar="R", help="LoRA rank (adapters on every block linear)")
    p.add_argument(
        "--load-in-4bit", action="store_true", help="4-bit (NF4) frozen base weights, with --lora-r"
    )
    p.add_argument(
        "--micro-batch-size", metavar="B", default="1", help="rows per micro-batch (default: 1)"
    )
    p.add_argument(
        "--precision",
        metavar="|".join(PRECISIONS),
        help="default: bf16 (fp16 on GPUs without bf16, fp32 for a CPU profile)",
    )
    p.add_argument(
        "--attention",
        metavar="sdpa|flash_attention_2|eager",
        default="sdpa",
        help="attention kernel (default: sdpa)",
    )
    p.add_argument(
        "--gradient-checkpointing", action="store_true", help="recompute activations in backward"
    )
    p.add_argument(
        "--headroom",
        metavar="F",
        default="0.1",
        help="fraction of GPU memory kept free (default: 0.1)",
    )
    p.add_argument("--cache-dir", metavar="DIR", help="token-store cache for preparing --data")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_estimate)

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
    p.set_defaults(func=cmd_compare)

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
    p.set_defaults(func=cmd_report)


def _num(args: argparse.Namespace, name: str, problems: list[str], *, kind: type = float,
         lo: float | None = None, hi: float | None = None) -> Any:  # fmt: skip
    raw = getattr(args, name, None)
    if raw is None:
        return None
    flag = "--" + name.replace("_", "-")
    try:
        v = _float(str(raw))
        if kind is int:
            if not v.is_integer():
                raise ValueError
            v = int(v)
    except ValueError:
        problems.append(
            f"{flag} must be {'an integer' if kind is int else 'a number'}, got {raw!r}"
        )
        return None
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
        problems.append(f"{flag} must be {rng}, got {raw}")
        return None
    return v


def cmd_estimate(args: argparse.Namespace) -> int:
    from pitstop.report.estimate import (
        DEFAULT_SCALING,
        data_tokens,
        estimate,
        format_estimate,
        load_profile,
    )
    from pitstop.report.gpus import custom_gpu, find_gpu, get_gpu
    from pitstop.report.memory import shape_from_model_dir, shape_from_params

    problems: list[str] = []
    params = _num(args, "params", problems, lo=1)
    tokens = _num(args, "tokens", problems, kind=int, lo=1)
    epochs = _num(args, "epochs", problems, lo=1e-9)
    seq = _num(args, "max_seq_len", problems, kind=int, lo=8)
    mfu = _num(args, "mfu", problems, lo=1e-6, hi=1)
    price = _num(args, "price_per_gpu_hour", problems, lo=0)
    lora_r = _num(args, "lora_r", problems, kind=int, lo=1)
    mbs = _num(args, "micro_batch_size", problems, kind=int, lo=1)
    headroom = _num(args, "headroom", problems, lo=0, hi=0.9)
    scaling = _num(args, "scaling_efficiency", problems, lo=0.01, hi=1)
    counts: list[int] = []
    for c in str(args.gpus).split(","):
        c = c.strip()
        if not c.isdigit() or int(c) < 1:
            problems.append(
                f"--gpus must be a comma-separated list of positive integers, got {args.gpus!r}"
            )
            break
        counts.append(int(c))
    if not args.model and params is None:
        problems.append("give --model DIR (exact) or --params N (a rough Llama-shaped guess)")
    if args.data and tokens is not None:
        problems.append("give --data or --tokens, not both")
    if not args.data and tokens is None:
        problems.append("give --data FILE_OR_STORE or --tokens T: how much data the run sees")
    gpu_tflops = _num(args, "gpu_tflops", problems, lo=1e-3)
    gpu_mem = _num(args, "gpu_memory_gib", problems, lo=0.1)
    custom = gpu_tflops is not None or gpu_mem is not None
    if not args.gpu and not args.from_profile and not custom:
        problems.append("give --gpu NAME (with an optional --mfu) or --from-profile PROFILE")
    if args.precision is not None and args.precision not in PRECISIONS:
        problems.append(
            f"--precision must be one of {', '.join(PRECISIONS)}, got {args.precision!r}"
        )
    if args.attention not in ("sdpa", "flash_attention_2", "eager"):
        problems.append(
            f"--attention must be sdpa, flash_attention_2 or eager, got {args.attention!r}"
        )
    if args.load_in_4bit and lora_r is None:
        problems.append(
            "--load-in-4bit trains a LoRA adapter on frozen 4-bit weights; add --lora-r R"
        )
    gpu = None
    if args.gpu or custom:
        try:
            gpu = custom_gpu(args.gpu, gpu_tflops, gpu_mem, price) if custom else get_gpu(args.gpu)
        except ConfigError as e:
            problems += e.problems
    if problems:
        raise ConfigError(problems, header=f"invalid estimate ({len(problems)} problem(s)):")

    profile = load_profile(args.from_profile) if args.from_profile else None
    precision = args.precision
    if precision is None:
        dev = gpu or (find_gpu(str((profile or {}).get("device", ""))) if profile else None)
        if dev is not None:
            precision = "bf16" if dev.bf16 else "fp16"
        elif profile is not None:
            precision = "fp32"  # a CPU profile: pitstop trains in fp32 there
        else:
            precision = "bf16"
    shape = shape_from_model_dir(args.model) if args.model else shape_from_params(params)
    toks = data_tokens(
        args.data, tokens, model_dir=args.model, max_seq_len=seq, cache_dir=args.cache_dir
    )
    est = estimate(
        shape,
        tokens=toks,
        epochs=epochs or 1.0,
        seq_len=seq,
        micro_batch_size=mbs or 1,
        precision=precision,
        attention=args.attention,
        gradient_checkpointing=args.gradient_checkpointing,
        lora_r=lora_r,
        load_in_4bit=args.load_in_4bit,
        gpu=gpu,
        mfu=mfu,
        profile=profile,
        gpu_counts=counts,
        scaling=scaling if scaling is not None else DEFAULT_SCALING,
        price=price,
        headroom=headroom if headroom is not None else 0.1,
        optimizer=args.optimizer,
    )
    print(json.dumps(est.to_dict(), indent=1) if args.json else format_estimate(est))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from pitstop.report.compare import compare, format_compare

    problems: list[str] = []
    price = _num(args, "price_per_gpu_hour", problems, lo=0)
    if problems:
        raise ConfigError(problems)
    result = compare(args.run_a, args.run_b, price)
    if args.json:
        print(json.dumps(result, indent=1, default=str))
    else:
        print(format_compare(result, markdown=args.markdown))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from pitstop.report.html import write_report

    problems: list[str] = []
    price = _num(args, "price_per_gpu_hour", problems, lo=0)
    if problems:
        raise ConfigError(problems)
    out = write_report(args.runs, args.output, price=price)
    print(f"report written to {out}")
    return 0
