"""The CPU step kernels pitstop writes or picks, against what they replace, side by side.

    .venv/bin/python -m bench.step_kernels [--rows 2] [--max-len 1024] [--vocab 8192] [--out F]

- The loss: `train/token_loss.py` (labels shifted, fp32 cross-entropy a block of rows at a
  time) against `F.cross_entropy(logits[:, :-1].float())`, forward + backward, bf16 and fp32
  logits.
- The attention: `sdpa_docs` (per-document causal SDPA over split views) against
  transformers' SDPA path for packed rows (a dense block-diagonal mask), forward + backward,
  heads 4 x 64, documents of 600/300/124 and 900/100/24 positions in two rows of 1024.
- The per-step non-finite weight check (`train/guard.py`: each parameter's aminmax on a
  CPU) against the foreach inf-norm it used before, over the same parameters.
- The optimizer step: torch's fused AdamW (pitstop's CPU choice, `probe.choose_optimizer`)
  against foreach AdamW (its CPU choice before), on the headline model's parameters (a
  4-layer, 256-wide Llama with an 8k vocabulary: 8.4M) in pitstop's two parameter groups.

Interleaved rounds, medians of 7. Writes bench/results/step_kernels.md.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

from bench.common import markdown_table, median, write_result


def _timed(fn: Callable[[], object], rounds: int = 7) -> list[float]:
    fn()  # warm-up: the kernels' first dispatch
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def bench_loss(rows: int, max_len: int, vocab: int) -> list[list[str]]:
    import torch
    import torch.nn.functional as F

    from pitstop.train.token_loss import chunked_token_ce, shifted_targets

    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, vocab, (rows, max_len), generator=g)
    out = []
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(rows, max_len, vocab, generator=g) * 3).to(dtype).requires_grad_()

        def before(x: torch.Tensor = x) -> None:
            loss = F.cross_entropy(
                x[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), reduction="sum"
            )
            torch.autograd.grad(loss, x)

        def now(x: torch.Tensor = x) -> None:
            torch.autograd.grad(chunked_token_ce(x.flatten(0, 1), shifted_targets(labels)), x)

        a, b = [], []
        for _ in range(3):  # interleaved: a busy moment hits both
            a += _timed(before, 3)
            b += _timed(now, 3)
        out.append([f"loss, {str(dtype).split('.')[-1]} logits", f"{median(a) * 1e3:.1f}",
                    f"{median(b) * 1e3:.1f}", f"{median(a) / median(b):.2f}x"])  # fmt: skip
    return out


def bench_attention(max_len: int) -> list[list[str]]:
    import torch

    from pitstop.train.attention import doc_boundaries
    from pitstop.train.doc_attention import per_document_sdpa

    docs = [[600, 300, max_len - 900], [900, 100, max_len - 1000]]
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in docs])
    cu, _ = doc_boundaries(pos)
    B, H, T, D = 2, 4, max_len, 64
    # transformers' SDPA path for packed rows: a block-diagonal causal mask, all T x T scores.
    doc = torch.cumsum((pos == 0).int(), dim=1)
    same = doc[:, :, None] == doc[:, None, :]
    mask = (same & torch.ones(T, T, dtype=torch.bool).tril())[:, None]
    g = torch.Generator().manual_seed(0)
    out = []
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v = (torch.randn(B, T, H, D, generator=g).to(dtype).transpose(1, 2).requires_grad_()
                   for _ in range(3))  # fmt: skip

        def dense(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v) -> None:
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            torch.autograd.grad(o.float().sum(), (q, k, v))

        def per_doc(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v) -> None:
            torch.autograd.grad(per_document_sdpa(q, k, v, cu).float().sum(), (q, k, v))

        a, b = [], []
        for _ in range(3):
            a += _timed(dense, 3)
            b += _timed(per_doc, 3)
        out.append([f"attention, {str(dtype).split('.')[-1]}", f"{median(a) * 1e3:.1f}",
                    f"{median(b) * 1e3:.1f}", f"{median(a) / median(b):.2f}x"])  # fmt: skip
    return out


def bench_optimizer(vocab: int) -> list[list[str]]:
    import torch
    from transformers import LlamaForCausalLM

    from pitstop.tiny import llama_config
    from pitstop.train.optim import param_groups

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(vocab, layers=4, hidden=256, heads=4))
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    steps = {
        kind: torch.optim.AdamW(
            param_groups(model, 0.0), lr=1e-3, betas=(0.9, 0.95), **{kind: True}
        )
        for kind in ("foreach", "fused")
    }  # both update the same parameters: only the time is compared
    a, b = [], []
    for _ in range(3):
        a += _timed(steps["foreach"].step, 3)
        b += _timed(steps["fused"].step, 3)
    n = sum(p.numel() for p in model.parameters()) / 1e6
    return [[f"AdamW step, {n:.1f}M fp32 parameters (foreach / fused)", f"{median(a) * 1e3:.1f}",
             f"{median(b) * 1e3:.1f}", f"{median(a) / median(b):.2f}x"]]  # fmt: skip


def bench_weight_check(vocab: int) -> list[list[str]]:
    """The per-step non-finite weight check (train/guard.py) against the foreach inf-norm
    it used on every device before."""
    import torch
    from transformers import LlamaForCausalLM

    from pitstop.tiny import llama_config
    from pitstop.train.guard import nonfinite_weights

    torch.manual_seed(0)
    params = list(LlamaForCausalLM(llama_config(vocab, layers=4, hidden=256, heads=4)).parameters())
    local = [p.detach() for p in params]

    def before() -> None:
        torch.isfinite(torch.stack(torch._foreach_norm(local, float("inf")))).all()

    a, b = [], []
    for _ in range(3):
        a += _timed(before, 3)
        b += _timed(lambda: nonfinite_weights(params), 3)
    n = sum(p.numel() for p in params) / 1e6
    return [[f"non-finite weight check, {n:.1f}M parameters (inf-norm / aminmax)",
             f"{median(a) * 1e3:.2f}", f"{median(b) * 1e3:.2f}",
             f"{median(a) / median(b):.2f}x"]]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--out", type=Path, help="results file (default bench/results/step_kernels.md)")
    args = ap.parse_args()
    if args.max_len < 1001:
        ap.error("--max-len must be at least 1001 (the attention case's documents)")
    rows = bench_loss(args.rows, args.max_len, args.vocab) + bench_attention(args.max_len)
    rows += bench_optimizer(args.vocab) + bench_weight_check(args.vocab)
    table = markdown_table(["kernel (forward + backward)", "before / dense ms", "pitstop ms",
                            "speed-up"], rows)  # fmt: skip
    print(table)
    body = (
        f"{table}\n\nLoss: {args.rows} rows x {args.max_len} positions x {args.vocab} vocabulary; "
        "before = `F.cross_entropy(logits[:, :-1].float())`. Attention: 2 rows of "
        f"{args.max_len}, 4 heads x 64, 6 documents; dense = SDPA with the block-diagonal "
        "causal mask transformers builds for packed rows. Optimizer: one AdamW step over the "
        "headline model's parameters (4 layers, width 256, the vocabulary above), foreach "
        "against fused. Weight check: whether any of the same parameters is non-finite, "
        "the foreach inf-norm against pitstop's CPU check (`train/guard.py`: each "
        "parameter's aminmax). Medians of 9 interleaved samples."
    )
    write_result(
        "step_kernels",
        "CPU step kernels: pitstop's loss, attention, optimizer and weight check",
        body,
        path=args.out,
    )


if __name__ == "__main__":
    main()
