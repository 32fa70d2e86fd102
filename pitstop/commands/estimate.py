"""`pitstop estimate`: flags -> `pitstop.report.planned.estimate_planned_run` -> table or JSON."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pitstop.core.config_ranges import COMMAND_FLAGS, flag_problems
from pitstop.core.errors import ConfigError
from pitstop.report.estimate import DEFAULT_SCALING, format_estimate
from pitstop.report.planned import PRECISIONS, estimate_planned_run, estimate_problems


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `estimate` subcommand to an argparse subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "estimate",
        allow_abbrev=False,
        help="memory, time and cost of a planned run (measured or from FLOPs and a GPU)",
        description="Memory per part, time and cost of a planned run, each with its basis.",
    )
    _add_run_flags(p)
    _add_device_flags(p)
    _add_options_flags(p)
    _add_plan_flags(p)
    p.add_argument("--cache-dir", metavar="DIR", help="token-store cache for preparing --data")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)
    return p


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    """What is trained, and for how long: the model, the data, the epochs, the row length."""
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--model",
        metavar="DIR",
        help="Hugging Face model directory (config.json is read; default with --from-profile: "
        "the model the run names)",
    )
    src.add_argument(
        "--params", metavar="N", help="parameter count for a rough Llama-shaped guess (e.g. 7e9)"
    )
    p.add_argument(
        "--data",
        metavar="FILE_OR_STORE",
        help="dataset file (prepared with --model's tokenizer) or token store",
    )
    p.add_argument(
        "--tokens",
        metavar="T",
        help="tokens per epoch (instead of --data; default with --from-profile: the trained "
        "tokens of the run)",
    )
    p.add_argument("--epochs", metavar="E", default="1", help="passes over the data (default: 1)")
    p.add_argument(
        "--max-seq-len", metavar="L", help="row length (default: the store's, else 1024)"
    )


def _add_device_flags(p: argparse.ArgumentParser) -> None:
    """What the time rests on: a measured run, or a GPU (the table's, or your own peak and
    memory), with the optimizer whose states count in memory and the MFU to assume."""
    p.add_argument(
        "--from-profile",
        metavar="PROFILE",
        help="profile.json, summary.json or a run directory: measured throughput, step and "
        "host time (with another --gpu only the device work scales; host time is kept)",
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
        default=None,
        help="optimizer whose states to count (8-bit AdamW: ~2 B per parameter instead of 8; "
        "default: the measured run's, else adamw)",
    )
    p.add_argument("--mfu", metavar="X", help="model FLOPs utilisation to assume (0-1)")


def _add_options_flags(p: argparse.ArgumentParser) -> None:
    """The options table: the GPU counts, the scaling kept per doubling, the price."""
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


def _add_plan_flags(p: argparse.ArgumentParser) -> None:
    """The run's plan: adapters, micro-batch, precision, kernel, recomputation, saves,
    tokens per step, and the memory kept free."""
    p.add_argument("--lora-r", metavar="R", help="LoRA rank (adapters on every block linear)")
    p.add_argument(
        "--load-in-4bit", action="store_true", help="4-bit (NF4) frozen base weights, with --lora-r"
    )
    p.add_argument(
        "--micro-batch-size",
        metavar="B",
        help="rows per micro-batch (default: the measured run's, else 1)",
    )
    p.add_argument(
        "--precision",
        metavar="|".join(PRECISIONS),
        help="default: bf16 (fp16 on GPUs without bf16, fp32 for a CPU profile)",
    )
    p.add_argument(
        "--attention",
        metavar="sdpa|flash_attention_2|flex_attention|eager",
        default="sdpa",
        help="attention kernel (default: sdpa)",
    )
    p.add_argument(
        "--gradient-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="recompute activations in backward (default: as the measured run did, else off)",
    )
    p.add_argument(
        "--save-steps", metavar="N", help="a checkpoint every N optimizer steps (its cost is added)"
    )
    p.add_argument(
        "--tokens-per-step",
        metavar="T",
        help="positions per optimizer step (default: the measured run's trained tokens per "
        "step, else one micro-batch)",
    )
    p.add_argument(
        "--disk-write-gbps",
        metavar="G",
        help="checkpoint write bandwidth in GB/s (default: 0.5, an assumption)",
    )
    p.add_argument(
        "--headroom",
        metavar="F",
        default="0.1",
        help="fraction of GPU memory kept free (default: 0.1)",
    )


def run(args: argparse.Namespace) -> int:
    # Each valid value becomes its number (a list for --gpus); an invalid one stays the
    # string given, so the checks below still count it as given, and every problem is
    # reported at once.
    problems = flag_problems(args, "estimate")
    bad = {n for n in COMMAND_FLAGS["estimate"] if isinstance(getattr(args, n), str)}
    problems += estimate_problems(
        model=args.model,
        params=args.params,
        data=args.data,
        tokens=args.tokens,
        gpu=args.gpu,
        from_profile=args.from_profile,
        precision=args.precision,
        attention=args.attention,
        lora_r=args.lora_r,
        load_in_4bit=args.load_in_4bit,
        gpu_tflops=None if "gpu_tflops" in bad else args.gpu_tflops,
        gpu_memory_gib=None if "gpu_memory_gib" in bad else args.gpu_memory_gib,
    )
    if problems:
        header = f"invalid estimate ({len(problems)} problem(s)):" if len(problems) > 1 else None
        raise ConfigError(problems, header=header)
    est = estimate_planned_run(
        model=args.model,
        params=args.params,
        data=args.data,
        tokens=args.tokens,
        epochs=args.epochs,
        max_seq_len=args.max_seq_len,
        from_profile=args.from_profile,
        gpu=args.gpu,
        mfu=args.mfu,
        gpu_counts=args.gpus,
        scaling=DEFAULT_SCALING if args.scaling_efficiency is None else args.scaling_efficiency,
        price=args.price_per_gpu_hour,
        lora_r=args.lora_r,
        load_in_4bit=args.load_in_4bit,
        micro_batch_size=args.micro_batch_size,
        precision=args.precision,
        attention=args.attention,
        gradient_checkpointing=args.gradient_checkpointing,
        headroom=args.headroom,
        cache_dir=args.cache_dir,
        gpu_tflops=args.gpu_tflops,
        gpu_memory_gib=args.gpu_memory_gib,
        optimizer=args.optimizer,
        save_steps=args.save_steps,
        tokens_per_step=args.tokens_per_step,
        disk_write_gbps=args.disk_write_gbps,
    )
    print(json.dumps(est.to_dict(), indent=1) if args.json else format_estimate(est))
    return 0
