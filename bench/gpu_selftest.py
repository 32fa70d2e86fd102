"""What only a GPU can settle (issue 26), checked on yours: a pass/fail table.

    python -m bench.gpu_selftest                  # on a CUDA machine: every check, bf16
    python -m bench.gpu_selftest --only window,syncs     # a subset, by check name
    python -m bench.gpu_selftest --model DIR [--lora-r R]  # your model's start-up check
    python -m bench.gpu_selftest --cpu            # the harness itself on the CPU (fp32,
                                                  # gloo, small sizes); CUDA-only rows skip

Checks, by the name `--only` takes (docs/gpu.md says what each protects against and what
to do when it fails; the code is in bench/gpu_checks_*.py):

- packed: per kernel, pitstop's start-up packed-attention self-check (train/packcheck.py);
- window: sdpa_docs (and flash_attention_2 where it runs) on models with sliding windows
  (Mistral, Gemma 3, Phi-3; Gemma 2's softcap must be matched or refused), a packed
  micro-batch against each document alone under eager; also runs on the CPU (fp32);
- backends: sdpa_docs forward+backward, bf16 and fp32, with SDPA's math backend ruled out;
- throughput: tokens/s of sdpa_docs vs sdpa (dense mask) vs flash_attention_2 on packed
  rows of 64-, 256- and 1024-token documents (informational);
- syncs: three steps of pitstop's Trainer under torch.cuda.set_sync_debug_mode("error");
- recompiles: torch.compile of a model with sdpa_docs over ten document layouts, 1- and
  2-row micro-batches: one graph, no graph break, eager's loss and gradients;
- compile_ddp: `--compile on` compiles the DDP wrapper and falls back to it;
- fsdp_mp: FSDP2's bf16 policy runs and matches the unsharded autocast loss;
- staging: checkpoint host buffers pinned, the state's exact bytes (tied weights once),
  reused, and holding the values of the moment they were staged;
- sizer: the micro-batch sizer's prediction bounds a real step's peak;
- multi: with two GPUs, NCCL DDP and FSDP2 steps (ranks equal after the step) and DDP
  accumulation memory against the sizer;
- matmul: a bf16 8192^3 matmul's TFLOP/s against pitstop's GPU peak table;
- model (only with --model): the start-up self-check on your model directory.

Every check runs on its own: one that fails or crashes is a FAIL row, the others still run.
On a machine without CUDA it prints why nothing ran and exits 0 (tests run that).
Exit code 1 when any check fails, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.gpu_checks_attention import check_backends, check_model, check_packed, check_window
from bench.gpu_checks_memory import check_sizer, check_staging
from bench.gpu_checks_multi import check_multi
from bench.gpu_checks_speed import check_matmul, check_throughput
from bench.gpu_checks_train import (
    check_compile_ddp,
    check_fsdp_mp,
    check_recompiles,
    check_syncs,
)
from bench.gpu_checks_util import Row, isolated, short_error

__all__ = ["CHECKS", "NO_CUDA", "Row", "check_name", "main", "run_checks", "table"]

NO_CUDA = "no CUDA device: torch sees none, so no GPU check ran (run this on a GPU machine)"

Check = Callable[[torch.device, str], list[Row]]

CHECKS: list[Check] = [
    check_packed, check_window, check_backends, check_staging, check_sizer, check_matmul,
    check_throughput, check_syncs, check_recompiles, check_compile_ddp, check_fsdp_mp,
    check_multi,
]  # fmt: skip


def check_name(fn: Callable[..., Any]) -> str:
    return fn.__name__.removeprefix("check_")


def model_check(model_dir: str, lora_r: int | None) -> Check:
    """The `model` check bound to the user's directory."""

    def check_model_dir(dev: torch.device, precision: str) -> list[Row]:
        return check_model(dev, precision, model_dir=model_dir, lora_r=lora_r)

    check_model_dir.__name__ = "check_model"
    return check_model_dir


def run_checks(dev: torch.device, precision: str, checks: list[Check] | None = None) -> list[Row]:
    """Run `checks` (default: CHECKS), each on its own; a crash is that check's FAIL row."""
    rows: list[Row] = []
    for fn in CHECKS if checks is None else checks:
        t0 = time.perf_counter()
        try:
            with isolated(dev):
                got = fn(dev, precision)
        except Exception as e:  # a check that crashes is a failed check, the others still run
            got = [Row(check_name(fn), "FAIL", f"raised {short_error(e)}")]
        for r in got:
            r.detail += f" [{time.perf_counter() - t0:.1f} s]"
        rows.extend(got)
    return rows


def table(rows: list[Row]) -> str:
    w = max(len(r.check) for r in rows)
    lines = [f"{'check':<{w}}  result  detail", f"{'-' * w}  ------  ------"]
    lines += [f"{r.check:<{w}}  {r.status:<6}  {r.detail}" for r in rows]
    return "\n".join(lines)


def select(only: str | None, model: Check | None) -> list[Check] | str:
    """The checks to run, or what is wrong with the arguments."""
    available = {check_name(fn): fn for fn in CHECKS}
    if model is not None:
        available["model"] = model
    if only is None:
        return [model] if model is not None else list(CHECKS)
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in available]
    if unknown:
        need = " (needs --model DIR)" if "model" in unknown else ""
        return f"--only: unknown check(s) {', '.join(unknown)}{need}; the checks are: " + ", ".join(
            [*(check_name(fn) for fn in CHECKS), "model"]
        )
    picked = [available[n] for n in dict.fromkeys(names)]
    if model is not None and model not in picked:
        picked.append(model)
    return picked


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.gpu_selftest", description=(__doc__ or "").split("\n")[0]
    )
    ap.add_argument("--cpu", action="store_true", help="run the harness on the CPU (fp32, gloo)")
    ap.add_argument("--only", metavar="NAME[,NAME]", help="run only these checks (see --help)")
    ap.add_argument("--model", metavar="DIR", help="run the start-up self-check on this model")
    ap.add_argument("--lora-r", type=int, metavar="R", help="with --model: as a LoRA run of rank R")
    args = ap.parse_args(argv)
    if args.lora_r is not None and args.model is None:
        print("pitstop gpu selftest: --lora-r needs --model DIR", file=sys.stderr)
        return 2
    model = model_check(args.model, args.lora_r) if args.model else None
    checks = select(args.only, model)
    if isinstance(checks, str):
        print(f"pitstop gpu selftest: {checks}", file=sys.stderr)
        return 2
    if args.cpu:
        dev, precision = torch.device("cpu"), "fp32"
    elif not torch.cuda.is_available():
        print(f"pitstop gpu selftest: {NO_CUDA}")
        return 0
    else:
        dev, precision = torch.device("cuda", torch.cuda.current_device()), "bf16"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # loading and saving bars between the rows' output
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (harness dry run)"
    print(f"pitstop gpu selftest on {where}: torch {torch.__version__}, "
          f"transformers {transformers.__version__}, {precision}", flush=True)  # fmt: skip
    t0 = time.perf_counter()
    rows = run_checks(dev, precision, checks)
    print(table(rows))
    failed = [r for r in rows if r.status == "FAIL"]
    print(f"{len(rows) - len(failed)} of {len(rows)} passed or skipped; {len(failed)} failed "
          f"({time.perf_counter() - t0:.0f} s)")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
