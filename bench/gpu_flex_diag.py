"""Is flex_attention's packed mismatch in bf16 rounding or a leak? (docs/gpu.md, 2026-11-26)

    python -m bench.gpu_flex_diag       # on a CUDA machine; without one it says so, exit 0

Prints pitstop's start-up check (train/attention_check.py) for flex_attention and sdpa_docs
on the self-test's tiny Llama in fp32 and under bf16 autocast, then flex_attention alone
(compiled and eager) with one dtype for queries, keys and values against SDPA on each
document. On the H200: fp32 4.9e-7, bf16 autocast 9.4e-2 (tolerance 3.4e-2), the kernel
alone in bf16 2.3e-3: rounding in how the model feeds flex under autocast, not a leak.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def main() -> int:
    if not torch.cuda.is_available():
        print("pitstop flex diagnosis: no CUDA device, nothing ran (run it on a GPU machine)")
        return 0
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from bench.gpu_checks_util import tiny_llama
    from pitstop.train.attention_check import packed_attention_check

    dev = torch.device("cuda")
    for precision, autocast in (("fp32", None), ("bf16", torch.bfloat16)):
        for kernel in ("flex_attention", "sdpa_docs"):
            check, fallback = packed_attention_check(
                tiny_llama(kernel, dev), dev, kernel, autocast, precision
            )
            print(precision, kernel, "ok" if check.ok else "DIFFERS", check.summary(), fallback)
    docs, heads, dim = [10, 14], 4, 32
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(docs)]).to(dev)
    total = sum(docs)

    def same_doc_causal(b, h, q, kv):
        return (doc[q] == doc[kv]) & (q >= kv)

    mask = create_block_mask(same_doc_causal, 1, 1, total, total, device=dev)
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v = (
            torch.randn(1, heads, total, dim, device=dev, generator=g, dtype=dtype)
            for _ in range(3)
        )
        starts = [0, docs[0]]
        ref = torch.cat(
            [
                F.scaled_dot_product_attention(
                    *(x[:, :, s : s + n].float() for x in (q, k, v)), is_causal=True
                )
                for s, n in zip(starts, docs, strict=True)
            ],
            dim=2,
        )
        for name, fn in (("compiled", torch.compile(flex_attention)), ("eager", flex_attention)):
            out = fn(q, k, v, block_mask=mask).float()
            rel = float((out - ref).abs().max() / ref.abs().max())
            print(f"flex alone, {dtype}, {name}: largest relative difference {rel:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
