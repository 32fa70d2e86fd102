"""Batching benchmark: trained tokens/s of pack vs bucket vs pad, whether `batching: auto`'s
pick is the measured fastest, and what a packed row's attention costs against the same
documents in rows of their own.

    python -m bench.batching [--layers 4] [--hidden 256] [--max-seq-len 512] [--steps 4]
                             [--attention sdpa_docs|sdpa] [--precision auto|bf16|fp32]

Same model (a tiny Llama built locally), same data (the bundled instruction records,
prompts masked out of the loss, documents over max length split), same tokens per
optimizer step for every strategy. Each layout trains as `pitstop train` does on the CPU:
the attention kernel pitstop picks there (`sdpa_docs`, per-document SDPA; `--attention sdpa`
for transformers' dense-mask path, where `auto` times the layouts), bf16 autocast where the
CPU has native bf16 (`--precision`), pitstop's forward and loss (`train/forward.py`) and its
optimizer (fused AdamW). A step is forward+backward of each micro-batch plus the optimizer
step, timed from the first micro-batch's fetch to the end of the optimizer step; the table
reports the median over the measured steps (after warm-up steps that are not counted).
"Trained tokens" are loss targets (the numerator of `tokens_per_second` in summary.json).
`auto` runs as a first `pitstop train` does (with `sdpa_docs` on a CPU: the cost model, not
timed), and its pick is checked against the steps measured here. Prints a Markdown table
and writes bench/results/batching.md (or `--out`) with the machine it ran on.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from bench.common import describe_machine, machine, markdown_table, median, write_result
from pitstop.batching.auto import choose_batching
from pitstop.batching.records import MicroBatch
from pitstop.batching.resolve import loader_for
from pitstop.catalog.layouts import LAYOUT_NAMES
from pitstop.core.config import RunConfig
from pitstop.core.corpus import instruction_records
from pitstop.data.store import StoreWriter, TokenStore
from pitstop.tiny import build_model_dir


def cache_dir() -> Path:
    root = os.environ.get("PITSTOP_CACHE_DIR") or Path.home() / ".cache" / "pitstop"
    return Path(root) / "bench"


def make_store(dest: Path, tokenizer: Any, msl: int) -> TokenStore:
    """Instruction records -> token store: prompt tokens are context, completion tokens targets."""
    lengths: list[int] = []
    toks: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    eos = tokenizer.eos_token_id
    for r in instruction_records():
        p = tokenizer(r["prompt"])["input_ids"]
        c = [*tokenizer(r["completion"], add_special_tokens=False)["input_ids"], eos]
        ids = np.asarray(p + c, dtype=np.int64)
        m = np.r_[np.zeros(len(p), np.uint8), np.ones(len(c), np.uint8)]
        for a in range(0, len(ids), msl):  # split long documents into consecutive chunks
            chunk_m = m[a : a + msl].copy()
            chunk_m[0] = 0  # a sequence's first token is never a target
            toks.append(ids[a : a + msl])
            masks.append(chunk_m)
            lengths.append(len(chunk_m))
    w = StoreWriter(dest, vocab_size=len(tokenizer))
    w.append(np.concatenate(toks), np.concatenate(masks), lengths, np.arange(len(lengths)))
    w.finish({"max_seq_len": msl, "pad_token_id": tokenizer.pad_token_id})
    return TokenStore(dest)


CPU = torch.device("cpu")


@dataclass(frozen=True)
class Kernels:
    """What each layout trains with: the attention kernel and the autocast dtype."""

    attention: str
    autocast: torch.dtype | None

    def describe(self) -> str:
        return f"{'bf16 autocast' if self.autocast else 'fp32'}, {self.attention} attention"


def load_model(model_dir: Path, attention: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from pitstop.train.doc_attention import register

    register()  # sdpa_docs, as a pitstop run registers it
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation=attention, dtype=torch.float32
    )
    model.train()
    return model


def micro_loss(model: torch.nn.Module, batch: MicroBatch, kernels: Kernels) -> torch.Tensor:
    """Summed target cross-entropy of a micro-batch (the trainer divides by step_targets),
    computed as the trainer computes it."""
    from pitstop.train.forward import to_device, token_loss_sum

    on_device = to_device(batch, CPU, kernels.attention)
    return token_loss_sum(model, on_device, "cpu", kernels.autocast)


class StrategyRun:
    """One strategy's model, optimizer and loader; `step(i)` trains optimizer step `i` of the
    epoch (the loader's micro-batches of the steps before it are skipped, untrained).

    The benchmark interleaves the strategies step by step, so load from anything else
    on the machine slows all of them alike instead of whichever ran at the wrong time.
    The steps it trains are spread over the epoch: the plan's rows start with the longest
    documents of its look-ahead window (pitstop/batching/plan.py), so its first steps hold
    the longest documents, and those alone would make every layout look fully packed.
    """

    def __init__(
        self,
        strategy: str,
        store: TokenStore,
        model_dir: Path,
        base: dict[str, Any],
        kernels: Kernels,
    ) -> None:
        from pitstop.probe import choose_optimizer, detect_device
        from pitstop.train.optim import build_optimizer

        torch.manual_seed(0)
        self.strategy, self.kernels = strategy, kernels
        self.model = load_model(model_dir, kernels.attention)
        choice = choose_optimizer(detect_device("cpu")[0])  # pitstop's (fused AdamW)
        self.opt = build_optimizer(self.model, lr=1e-4, weight_decay=0.0, choice=choice)
        self.loader = loader_for(store, RunConfig(**base, batching=strategy, epochs=1))
        self.efficiency = self.loader.efficiency().packing_efficiency
        self.batches = iter(self.loader)
        self.rates: dict[str, list[float]] = {"trained": [], "seen": [], "positions": [], "s": []}

    def step(self, index: int, record: bool) -> None:
        batch = next(self.batches)
        while batch["meta"].step < index:
            batch = next(self.batches)
        t0 = time.perf_counter()
        seen = pos = 0
        while True:
            m = batch["meta"]
            (micro_loss(self.model, batch, self.kernels) / m.step_targets).backward()
            seen += m.n_seen
            pos += m.n_positions
            if m.micro_index == m.micro_count - 1:
                break
            batch = next(self.batches)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        if record:
            self.rates["trained"].append(m.step_targets / dt)
            self.rates["seen"].append(seen / dt)
            self.rates["positions"].append(pos / dt)
            self.rates["s"].append(dt)

    def summary(self) -> dict[str, Any]:
        r = self.rates
        return {
            "strategy": self.strategy,
            "trained_tps": median(r["trained"]),
            "seconds": list(r["s"]),
            "seen_tps": median(r["seen"]),
            "positions_ps": median(r["positions"]),
            "step_s": median(r["s"]),
            "efficiency": self.efficiency,
            "steps_per_epoch": self.loader.steps_per_epoch,
        }


def _interleaved_medians(fns: tuple[Any, ...], reps: int = 5) -> list[float]:
    """Median seconds of each function, run round-robin (after one untimed call each)."""
    for fn in fns:
        fn()
    ts: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            ts[i].append(time.perf_counter() - t)
    return [median(t) for t in ts]


def attention_check(
    model_dir: Path, n_docs: int, doc_len: int, kernels: Kernels
) -> tuple[list[list[str]], list[tuple[float, float]]]:
    """Packed row of n_docs short documents vs the same documents as separate rows vs one
    long doc: the SDPA op under transformers' dense block mask, then the whole model as
    `kernels` train it."""
    T = n_docs * doc_len
    rows: list[list[str]] = []
    ratios: list[tuple[float, float]] = []  # (packed / separate, packed / one row) per level
    # 1. The attention op alone (fwd+bwd), as transformers calls it for each layer.
    H, D = 4, 64
    q = torch.randn(1, H, T, D, requires_grad=True)
    doc = torch.arange(T) // doc_len
    block_causal = (doc[:, None] == doc[None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    qs = torch.randn(n_docs, H, doc_len, D, requires_grad=True)

    def op_packed() -> None:
        F.scaled_dot_product_attention(q, q, q, attn_mask=block_causal).sum().backward()

    def op_separate() -> None:
        F.scaled_dot_product_attention(qs, qs, qs, is_causal=True).sum().backward()

    def op_full() -> None:
        F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()

    # 2. The whole model (fwd+bwd), with the batches the loader builds, as pitstop runs them.
    model = load_model(model_dir, kernels.attention)
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (1, T))
    packed_pos = torch.arange(T)[None] % doc_len

    def run(input_ids: torch.Tensor, pos: torch.Tensor) -> None:
        batch = {"input_ids": input_ids, "labels": input_ids, "position_ids": pos}
        micro_loss(model, batch, kernels).backward()  # type: ignore[arg-type]
        model.zero_grad(set_to_none=True)

    def m_packed() -> None:
        run(ids, packed_pos)

    def m_separate() -> None:
        run(ids.view(n_docs, doc_len), torch.arange(doc_len)[None].expand(n_docs, -1))

    def m_full() -> None:
        run(ids, torch.arange(T)[None])

    for name, fns in (
        ("SDPA op under a dense block mask, 4 heads x 64", (op_packed, op_separate, op_full)),
        (f"whole model fwd+bwd, {kernels.describe()}", (m_packed, m_separate, m_full)),
    ):
        packed, separate, full = _interleaved_medians(fns)
        ratios.append((packed / separate, packed / full))
        rows.append(
            [
                name,
                f"{packed * 1e3:.1f}",
                f"{separate * 1e3:.1f}",
                f"{full * 1e3:.1f}",
                f"{packed / separate:.2f}×",
                f"{packed / full:.2f}×",
            ]
        )
    return rows, ratios


def pick_verdict(picked: dict[str, Any], results: list[dict[str, Any]]) -> str:
    """Whether auto's pick is the measured fastest, step against step: every layout trained
    the same steps (the same documents), so each step's seconds pair up across layouts."""
    mine = picked["seconds"]
    parts, beaten = [], False
    for other in results:
        if other is picked:
            continue
        theirs = other["seconds"]
        wins = sum(a < b for a, b in zip(mine, theirs, strict=True))
        ratio = median([b / a for a, b in zip(mine, theirs, strict=True)])
        beaten |= ratio < 1
        parts.append(
            f"{other['strategy']} took {ratio:.2f}x its seconds (median of {len(mine)} paired "
            f"steps; {picked['strategy']} faster in {wins})"
        )
    head = "is not the measured fastest" if beaten else "is the measured fastest"
    return f"**auto's pick, {picked['strategy']}, {head}**: " + "; ".join(parts) + "."


def attention_verdict(ratios: list[tuple[float, float]], kernels: Kernels) -> str:
    """What the attention check says about pricing a packed row."""
    (op_sep, op_full), (m_sep, m_full) = ratios
    dense = (
        f"Under transformers' dense block mask the packed row's attention costs {op_sep:.1f}x "
        f"the separate documents' and {op_full:.2f}x one causal row of the same length: CPU "
        "SDPA with an explicit mask computes every query-key pair of the row and masks "
        "afterwards (and loses the causal fast path)"
    )
    if kernels.attention == "sdpa":
        return (
            f"{dense}; the whole model {m_sep:.2f}x separate, {m_full:.2f}x one row. That is "
            "why `auto` times the layouts for this kernel instead of pricing positions."
        )
    return (
        f"{dense}. With {kernels.attention} each document is its own causal call: the whole "
        f"model's packed row costs {m_sep:.2f}x the same documents in rows of their own and "
        f"{m_full:.2f}x one causal row. `auto`'s cost model prices the layouts by positions "
        "alone, which assumes the first ratio is 1x."
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--rows-per-step", type=int, default=8, help="tokens per step = rows x max len")
    ap.add_argument(
        "--micro-rows",
        type=int,
        default=0,
        help="micro-batch budget in full rows (0: a CPU run's default, ~2,048 positions)",
    )
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=12, help="measured steps, spread over the epoch")
    ap.add_argument(
        "--attention",
        choices=("sdpa_docs", "sdpa"),
        default="sdpa_docs",
        help="sdpa_docs: pitstop's CPU kernel (default); sdpa: transformers' dense mask",
    )
    ap.add_argument(
        "--precision",
        choices=("auto", "bf16", "fp32"),
        default="auto",
        help="auto: bf16 autocast where the CPU has native bf16, as pitstop picks there",
    )
    ap.add_argument("--out", type=Path, help="results file (default bench/results/batching.md)")
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads (0: torch's default, or 1 when the machine is already busy)",
    )
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    load_before = os.getloadavg()[0]
    cores = os.cpu_count() or 1
    if args.threads:
        torch.set_num_threads(args.threads)
        threads_note = f"{args.threads} torch thread(s) (set)"
    elif load_before > 0.75 * cores:
        # Measured here: with other processes on every core, OpenMP's spinning threads
        # made a 2-thread forward+backward 5x slower than 1 thread; 1 thread keeps it sane.
        torch.set_num_threads(1)
        threads_note = (
            f"1 torch thread: the machine was busy (load average {load_before:.1f} on "
            f"{cores} cores), where more threads measured slower and noisier"
        )
    else:
        threads_note = f"{torch.get_num_threads()} torch threads (default)"
    print(f"threads: {threads_note}")
    from pitstop.probe import cpu_has_bf16

    bf16 = args.precision == "bf16" or (args.precision == "auto" and cpu_has_bf16())
    kernels = Kernels(args.attention, torch.bfloat16 if bf16 else None)
    info = machine()
    print(f"machine: {describe_machine(info)}")
    msl = args.max_seq_len
    from pitstop.batching.resolve import cpu_micro_rows

    # A CPU run's default split when none is asked for (None: BatchSettings' own default).
    micro_rows = args.micro_rows or cpu_micro_rows(args.rows_per_step, msl)
    model_dir = build_model_dir(
        cache_dir() / f"tiny-l{args.layers}-h{args.hidden}",
        layers=args.layers,
        hidden=args.hidden,
        heads=max(1, args.hidden // 64),
    )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = {
        "max_seq_len": msl,
        "tokens_per_step": args.rows_per_step * msl,
        "tokens_per_micro_batch": micro_rows * msl if micro_rows else None,
        "loader_workers": 0,
        "seed": 0,
    }
    with tempfile.TemporaryDirectory() as tmp:
        store = make_store(Path(tmp) / "store", tokenizer, msl)
        print(f"store: {len(store):,} sequences, {store.n_tokens:,} tokens, max length {msl}")
        runs = [StrategyRun(s, store, model_dir, base, kernels) for s in LAYOUT_NAMES]
        micro_positions = runs[0].loader.settings.tokens_per_micro_batch
        n_steps = {run.loader.steps_per_epoch for run in runs}
        assert len(n_steps) == 1, f"layouts of one plan with {n_steps} steps"  # same plan
        last = n_steps.pop() - 1
        picks = sorted({round(x) for x in np.linspace(0, last, args.warmup + args.steps)})
        for i, index in enumerate(picks):
            for run in runs:
                run.step(index, record=i >= args.warmup)
        results = [run.summary() for run in runs]
        for r in results:
            print(f"  {r['strategy']}: {r['trained_tps']:,.0f} trained tok/s")
        del runs
        torch.manual_seed(0)
        from pitstop.train.forward import TimedMicroBatch

        auto_model = load_model(model_dir, kernels.attention)
        run_micro_batch = TimedMicroBatch(auto_model, CPU, kernels.attention, kernels.autocast)
        t = time.perf_counter()
        choice = choose_batching(store, RunConfig(**base), run_micro_batch)
        auto_s = time.perf_counter() - t
    best = max(results, key=lambda r: r["trained_tps"])
    table = markdown_table(
        [
            "batching",
            "trained tok/s",
            "vs pad",
            "seen tok/s",
            "positions/s",
            "packing efficiency",
            "s/step",
            "steps/epoch",
        ],
        [
            [
                r["strategy"] + (" (fastest)" if r is best else ""),
                f"{r['trained_tps']:,.0f}",
                f"{r['trained_tps'] / results[-1]['trained_tps']:.2f}×",
                f"{r['seen_tps']:,.0f}",
                f"{r['positions_ps']:,.0f}",
                f"{r['efficiency']:.1%}",
                f"{r['step_s']:.2f}",
                r["steps_per_epoch"],
            ]
            for r in results
        ],
    )
    n_docs, doc_len = 16, 64
    att_rows, ratios = attention_check(model_dir, n_docs, doc_len, kernels)
    att = markdown_table(
        [
            "measured (median of 5)",
            "packed row, ms",
            "separate rows, ms",
            "one causal row, ms",
            "packed / separate",
            "packed / one row",
        ],
        att_rows,
    )
    verdict = attention_verdict(ratios, kernels)
    picked = next(r for r in results if r["strategy"] == str(choice.strategy))
    body = "\n".join(
        [
            f"Tiny Llama {args.layers} layers x {args.hidden} wide ({kernels.describe()}, "
            "pitstop's loss and fused AdamW), "
            f"bundled instruction records (prompts masked), max length {msl}, "
            f"{base['tokens_per_step']:,} tokens per optimizer step, micro-batches of up to "
            f"{micro_positions:,} positions. Medians over {args.steps} steps "
            f"spread evenly over the epoch of {last + 1} (the same steps of the same plan for "
            f"every layout) after {args.warmup} warm-up step(s), layouts interleaved step by "
            "step; the packing efficiency is the whole epoch's.",
            "",
            table,
            "",
            f"`batching: auto` picked **{choice.strategy}** in {auto_s:.1f} s: {choice.reason}.",
            "",
            pick_verdict(picked, results),
            "",
            f"### Does a packed row pay for its whole length squared? ({n_docs} documents x "
            f"{doc_len} tokens)",
            "",
            att,
            "",
            verdict,
            "",
            f"Threads: {threads_note}. Load average (1 min) {load_before:.1f} at the start, "
            f"{os.getloadavg()[0]:.1f} at the end; strategies ran interleaved step by step so "
            "background load affects them alike. Benchmark wall time: "
            f"{time.perf_counter() - t_start:.0f} s.",
        ]
    )
    print()
    print(body)
    path = write_result(
        "batching", "Batching: pack vs bucket vs pad", body, machine_info=info, path=args.out
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
