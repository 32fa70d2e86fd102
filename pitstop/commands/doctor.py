"""`pitstop doctor`: flags -> `pitstop.advise.doctor.doctor` -> ranked findings."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pitstop.commands.flags import check_number_flags
from pitstop.commands.paths import require_outputs
from pitstop.core import log
from pitstop.core.cache_layout import cache_root
from pitstop.core.config import RunConfig, build_config, load_yaml
from pitstop.core.errors import ConfigError
from pitstop.core.hub import model_dir
from pitstop.measure.schema import load_profile
from pitstop.measure.verdict import Verdict, format_verdict


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `doctor` subcommand to an argparse subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "doctor",
        allow_abbrev=False,
        help="audit the environment and a pitstop config or HF TrainingArguments -> ranked findings",
        description=(
            "Audit this machine and a training setup (a pitstop config, or Hugging Face "
            "TrainingArguments / TRL SFTConfig fields as JSON or YAML), optionally with the data's "
            "length statistics and a measured profile, and print ranked findings: each with its "
            "evidence, expected effect, the basis of that number, and the exact fix."
        ),
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", metavar="RUN_YAML", help="a pitstop run config (YAML)")
    src.add_argument(
        "--hf-args",
        metavar="FILE",
        help="TrainingArguments / SFTConfig fields as a JSON or YAML mapping (e.g. args.to_dict())",
    )
    p.add_argument(
        "--hf-class",
        choices=("auto", "TrainingArguments", "SFTConfig"),
        default="auto",
        help="which class the --hf-args fields belong to (default: SFTConfig if an SFT-only "
        "field such as packing or max_length is present)",
    )
    p.add_argument("--model", metavar="DIR", help="model directory (shape for FLOPs and memory)")
    p.add_argument(
        "--data",
        metavar="FILE_OR_STORE",
        help="a token store, or a dataset file (tokenized with --model's tokenizer)",
    )
    p.add_argument(
        "--profile",
        metavar="PROFILE_JSON_OR_RUN_DIR",
        help="a profile from `pitstop profile`, or a run directory holding one (made by "
        "`pitstop profile -- COMMAND` or PitstopCallback)",
    )
    p.add_argument(
        "--baseline",
        metavar="FILE",
        help="an earlier config of the same kind, to check that the effective batch is unchanged",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--output",
        metavar="DIR",
        help="also write the report to DIR/findings.json (a run directory: `pitstop report` shows it)",
    )
    t = p.add_argument_group(
        "target (audit for the machine and run you will rent; default: this machine)"
    )
    t.add_argument(
        "--gpu", metavar="NAME", help="GPU of the target (the estimate's names, e.g. H100)"
    )
    t.add_argument("--nproc", metavar="N", help="processes (GPUs) of the target run")
    t.add_argument("--cpus", metavar="N", help="CPU cores of the target machine")
    t.add_argument("--lora-r", metavar="R", help="the run trains a LoRA adapter of rank R")
    t.add_argument(
        "--load-in-4bit", action="store_true", help="the LoRA base weights are 4-bit (QLoRA)"
    )
    t.add_argument(
        "--transformers-version", metavar="X.Y.Z", help="transformers release the run will use"
    )
    p.add_argument("--cache-dir", metavar="DIR", help="cache for the compile check and data")
    p.add_argument(
        "--no-compile-check",
        action="store_true",
        help="skip test-compiling a tiny function (the check runs once and is cached)",
    )
    p.set_defaults(func=run)
    return p


def _load_config(path: str) -> RunConfig:
    # The doctor audits configs that may not name their data or model yet: the schema is
    # checked, and nothing is required (the "doctor" command requires no option).
    return build_config(load_yaml(path), source=path, command="doctor")


def run(args: argparse.Namespace) -> int:
    check_number_flags(args, "doctor")
    require_outputs(dirs={"--output": args.output})
    # Deferred: pitstop.advise probes the environment with torch, which `pitstop --help`
    # and the other commands must not pay for (about 25 s cold on the 2-core dev box).
    from pitstop.advise.doctor import doctor
    from pitstop.advise.environment import format_environment
    from pitstop.advise.finding import format_findings
    from pitstop.advise.hf_args import load_hf_args

    cache_dir = args.cache_dir
    if cache_dir is None:
        try:
            cache_dir = str(cache_root(None))
        except Exception:  # the cache location is a convenience for the compile check
            cache_dir = None
    if args.model:
        args.model = model_dir(args.model)  # a missing model is an error, not silence
    config = _load_config(args.config) if args.config else None
    hf = load_hf_args(args.hf_args) if args.hf_args else None
    baseline = None
    if args.baseline:
        if config is None and hf is None:
            raise ConfigError("--baseline needs --config or --hf-args to compare with")
        baseline = (
            _load_config(args.baseline) if config is not None else load_hf_args(args.baseline)
        )
    profile = load_profile(args.profile) if args.profile else None
    from pitstop.advise.target import make_target
    from pitstop.probe import detect_device

    target = make_target(
        detect_device("auto")[0],
        gpu=args.gpu,
        nproc=args.nproc,
        cpus=args.cpus,
        lora_r=args.lora_r,
        load_in_4bit=args.load_in_4bit,
        transformers_version=args.transformers_version,
    )
    report = doctor(
        config=config,
        hf_args=hf,
        hf_class=args.hf_class,
        model=args.model,
        data=args.data,
        profile=profile,
        baseline=baseline,
        cache_dir=cache_dir,
        compile_check=not args.no_compile_check,
        target=target,
        progress=not args.json,
    )
    if args.output:
        from pitstop.advise.doctor import write_findings

        log.info(f"findings written to {write_findings(report, args.output)}")
    if args.json:
        print(json.dumps(report, indent=1, default=str))
        return 0
    print(format_environment(report["environment"]))
    if report.get("audited_for"):
        print(report["audited_for"])
    precision = report["setup"].get("precision") or {}
    if report["setup"]["source"] == "pitstop" and precision:
        print(f"{'precision':<13}{precision['value']}: {precision['reason']}")
    if report["setup"].get("hf_class_reason"):
        print("fields read as " + report["setup"]["hf_class_reason"])
    if report.get("verdict"):
        v = report["verdict"]
        print()
        print(format_verdict(Verdict(**{**v, "also": [Verdict(**a) for a in v.get("also", [])]})))
    print()
    print(format_findings(report["findings"]))
    fields = report.get("fields") or {}
    if fields.get("unknown"):
        print("\nunknown fields (ignored): " + ", ".join(fields["unknown"]))
    if fields.get("not_checked"):
        print("not checked (no rule reads them): " + ", ".join(fields["not_checked"]))
    return 0
