"""Training-loop overhead: `pitstop.train.run` vs a bare loop over the same batches.

    .venv/bin/python -m bench.train [--steps 20] [--repeats 2]

The ceiling is the same model's forward / backward / clip / AdamW step over the same
micro-batches, pre-built and held in memory: nothing pitstop adds (loader, timeline,
metrics, progress bar, checkpoint bookkeeping) runs in it. Both sides use a tiny
Llama (4 layers, width 256, vocab 4096) built locally, fp32 on CPU (or the same
precision on CUDA), the same config and the same seed. Tokens/s is trained (target)
tokens per second of step time, the median over steps (the first step of each run,
which warms up kernels and allocators, is left out); the runs alternate
`--repeats` times. Writes a Markdown table to bench/results/train.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench.common import corpus_store

RESULTS = Path(__file__).parent / "results" / "train.md"


def _config(model_dir: Path, store: Path, out: Path, steps: int):
    from pitstop.core.config import build_config

    return build_config(
        {
            "model": str(model_dir),
            "data": [str(store)],
            "output": str(out),
            "max_seq_len": 256,
            "tokens_per_step": 2048,
            "micro_batch_size": 2,
            "batching": "pack",
            "max_steps": steps,
            "log_steps": 10,
            "report_to": ["none"],
            "compile": "off",
            "cache_dir": str(out.parent / "cache"),
            "overwrite": True,
        },
        None,
    )


def ceiling(cfg, steps: int) -> tuple[list[float], float]:
    """Per-step trained tokens/s of the bare loop over the same batches, in memory."""
    from transformers import AutoModelForCausalLM

    from pitstop.batching.resolve import loader_for
    from pitstop.data.store import TokenStore

    loader = loader_for(TokenStore(cfg.data[0]), cfg)
    batches: list[list[dict]] = [[] for _ in range(steps)]
    for mb in loader:
        batches[mb["meta"].step].append(mb)
    torch.manual_seed(cfg.seed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(cfg.model, attn_implementation="sdpa").to(dev)
    model.config.use_cache = False
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                            **({"fused": True} if dev == "cuda" else {"foreach": True}))  # fmt: skip
    rates = []
    for step in batches:
        t0 = time.perf_counter()
        targets = 0
        for mb in step:
            ids, lab, pos = (mb[k].to(dev) for k in ("input_ids", "labels", "position_ids"))
            logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), lab[:, 1:].flatten(),
                                   ignore_index=-100, reduction="sum") / mb["meta"].step_targets  # fmt: skip
            loss.backward()
            targets += mb["meta"].n_targets
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev == "cuda":
            torch.cuda.synchronize()
        rates.append(targets / (time.perf_counter() - t0))
    return rates[1:], 0.0


def pitstop_run(cfg) -> tuple[list[float], dict]:
    from pitstop.train import run

    s = run(cfg)
    lines = [json.loads(x) for x in (Path(cfg.output) / "metrics.jsonl").read_text().splitlines()]
    return [r["tokens_per_second"] for r in lines[1:]], s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    from pitstop.probe import cpu_name
    from pitstop.tiny import build_model_dir

    work = Path(tempfile.mkdtemp(prefix="pitstop-bench-train-"))
    model_dir = build_model_dir(work / "model", layers=4, hidden=256, heads=4, vocab_size=4096)
    store = corpus_store(work / "store", model_dir, 300, 256)
    cfg = _config(model_dir, store, work / "out", args.steps)
    ceil_rates: list[float] = []
    run_rates: list[float] = []
    summary: dict = {}
    for r in range(args.repeats):
        c, _ = ceiling(cfg, args.steps)
        p, summary = pitstop_run(cfg)
        ceil_rates += c
        run_rates += p
        print(f"repeat {r + 1}: ceiling {statistics.median(c):,.0f} tokens/s, "
              f"pitstop {statistics.median(p):,.0f} tokens/s", flush=True)  # fmt: skip
    ceil_med, run_med = statistics.median(ceil_rates), statistics.median(run_rates)
    fpt, peak = summary["flops_per_token"], summary["peak_flops"]
    pos_per_target = summary["padded_tokens"] / summary["trained_tokens"]

    def mfu(rate: float) -> str:
        return f"{100 * rate * pos_per_target * fpt / peak:.1f}%" if peak else "n/a"

    dev = summary["device"]
    machine = (
        f"{dev['name']}, {torch.get_num_threads()} torch threads, torch {torch.__version__}, "
        f"{platform.system()} {platform.machine()}"
        if dev["type"] == "cpu" else f"{dev['name']}, torch {torch.__version__}"
    )  # fmt: skip
    text = "\n".join([
        "# Training loop overhead: pitstop.train.run vs the bare loop",
        "",
        f"Machine: {machine}" + (f" ({cpu_name()})" if dev["type"] == "cpu" else ""),
        f"Model: tiny Llama, 4 layers, width 256, vocab 4096 "
        f"({summary['flops_per_token'] / 1e6:.1f} MFLOP/token); "
        f"{args.steps} steps x {args.repeats} runs each, 2048 tokens/step (8 packed rows of 256, "
        "micro-batches of 2 rows), fp32, SDPA, no compile.",
        f"Peak for MFU: {summary['peak_flops_source']} = {peak / 1e9:.1f} GFLOP/s." if peak else "",
        "",
        "| loop | trained tokens/s (median step) | MFU | share of ceiling |",
        "|---|---:|---:|---:|",
        f"| bare loop, batches in memory (ceiling) | {ceil_med:,.0f} | {mfu(ceil_med)} | 100% |",
        f"| `pitstop.train.run` | {run_med:,.0f} | {mfu(run_med)} | {100 * run_med / ceil_med:.1f}% |",
        "",
        "Command: `.venv/bin/python -m bench.train`. Goal: pitstop >= 95% of the ceiling.",
        "",
    ])  # fmt: skip
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
