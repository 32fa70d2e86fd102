"""Training-loop overhead: `pitstop.train.run` vs a bare loop over the same batches.

    .venv/bin/python -m bench.train [--steps 20] [--repeats 2]

The ceiling is the same model's forward / backward / clip / AdamW step over the same
micro-batches, pre-built and held in memory: nothing pitstop adds (loader, timeline,
metrics, progress bar, checkpoint bookkeeping) runs in it. It makes the choices pitstop's
run just made (its summary's precision, attention kernel and optimizer; freed host memory
stays kept, as pitstop's run left the process) and computes the loss with pitstop's own
forward (`pitstop.train.forward`), so it bounds pitstop's loop, not its choices. Both sides
use a tiny Llama (4 layers, width 256, vocab 4096) built locally, the same config and the
same seed. Tokens/s is trained (target) tokens per second of step time, the median over
steps (the first step of each run, which warms up kernels and allocators, is left out);
each repeat runs pitstop, then the ceiling, `--repeats` times. Writes a Markdown table to
bench/results/train.md.
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

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench.common import command_line, corpus_store
from pitstop.probe import Choice

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


def ceiling_choices(summary: dict) -> tuple[str, torch.dtype | None, Choice]:
    """The attention kernel, autocast dtype and optimizer of pitstop's run (its summary)."""
    from pitstop.train.forward import autocast_for

    choices = summary["choices"]
    optimizer = choices["optimizer"]
    return (
        choices["attention"]["value"],
        autocast_for(choices["precision"]["value"]),
        Choice(optimizer["value"], optimizer["reason"]),
    )


def ceiling(cfg, steps: int, summary: dict) -> tuple[list[float], float]:
    """Per-step trained tokens/s of the bare loop over the same batches, in memory."""
    from transformers import AutoModelForCausalLM

    from pitstop.batching.resolve import loader_for
    from pitstop.data.store import TokenStore
    from pitstop.train.attention_rows import apply_rows
    from pitstop.train.doc_attention import register
    from pitstop.train.forward import to_device, token_loss_sum
    from pitstop.train.optim import build_optimizer

    attention, autocast, optimizer = ceiling_choices(summary)
    register()  # sdpa_docs, when pitstop chose it
    loader = loader_for(TokenStore(cfg.data[0]), cfg)
    batches: list[list[dict]] = [[] for _ in range(steps)]
    for mb in loader:
        batches[mb["meta"].step].append(mb)
    torch.manual_seed(cfg.seed)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(cfg.model, attn_implementation=attention)
    model = model.to(dev)
    model.config.use_cache = False
    model.train()
    # How sdpa_docs computed in pitstop's run (a CPU's rows as matrix products, or not).
    apply_rows(model, bool(summary["choices"].get("attention_rows", {}).get("value")))
    opt = build_optimizer(model, lr=cfg.lr, weight_decay=cfg.weight_decay, choice=optimizer)
    on_device = [[(to_device(mb, dev, attention), mb["meta"]) for mb in step] for step in batches]
    rates = []
    for step in on_device:
        t0 = time.perf_counter()
        targets = 0
        for batch, meta in step:
            loss = token_loss_sum(model, batch, dev.type, autocast) / meta.step_targets
            loss.backward()
            targets += meta.n_targets
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
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
    ap.add_argument("--out", type=Path, default=RESULTS, help="results file (default %(default)s)")
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
        p, summary = pitstop_run(cfg)
        c, _ = ceiling(cfg, args.steps, summary)
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
        "micro-batches of 2 rows), no compile; both sides: "
        + ", ".join(f"{k} {summary['choices'][k]['value']}"
                    for k in ("precision", "attention", "optimizer", "host_memory")
                    if k in summary["choices"]) + ".",
        f"Peak for MFU: {summary['peak_flops_source']} = {peak / 1e9:.1f} GFLOP/s." if peak else "",
        "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        "| loop | trained tokens/s (median step) | MFU | share of ceiling |",
        "|---|---:|---:|---:|",
        f"| bare loop, batches in memory (ceiling) | {ceil_med:,.0f} | {mfu(ceil_med)} | 100% |",
        f"| `pitstop.train.run` | {run_med:,.0f} | {mfu(run_med)} | {100 * run_med / ceil_med:.1f}% |",
        "",
        f"Command: `{command_line()}`. Goal: pitstop >= 95% of the ceiling.",
        "",
    ])  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
