"""A training program in nanoGPT's style, for pitstop's real-client tests (tests/test_clients_*).

Its shape, as people write it: a decoder-only GPT defined in the script, batches cut by hand
from a `np.memmap` of token ids with `torch.randint` (no DataLoader), `logits, loss =
model(X, Y)` with targets already shifted, gradient accumulation, a GradScaler (a no-op on
the CPU), an `@torch.no_grad()` loss estimate over `--eval-iters` batches of each split every
`--eval-interval` steps, and a `torch.save` of a checkpoint dict after each estimate.

It writes the truth the tests compare pitstop with to `--truth FILE` (JSON): the tokens each
optimizer step trained on (batch x block x accumulation, counted from the batches), the
optimizer steps, the seconds of the training loop after its first iteration, and the seconds
of the loss estimates in them (the program's own clock).

    python tests/clients/nanogpt_loop.py --out DIR [--max-iters 30] [--eval-interval 10]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, block: int, layers: int, width: int, heads: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(block, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as GPT-2 and nanoGPT tie them

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1
            )
        return logits, loss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-iters", type=int, default=30)
    ap.add_argument("--eval-interval", type=int, default=10, help="0: no evaluation")
    ap.add_argument("--eval-iters", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--truth", default=None)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(1337)
    vocab = 256
    for split, n in (("train", 200_000), ("val", 20_000)):  # the prepared token files
        ids = np.random.default_rng(0).integers(0, vocab, n, dtype=np.uint16)
        ids.tofile(out / f"{split}.bin")

    def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
        data = np.memmap(out / f"{split}.bin", dtype=np.uint16, mode="r")
        ix = torch.randint(len(data) - a.block_size, (a.batch_size,))
        x = torch.stack([torch.from_numpy(data[i : i + a.block_size].astype(np.int64)) for i in ix])
        y = torch.stack(
            [torch.from_numpy(data[i + 1 : i + 1 + a.block_size].astype(np.int64)) for i in ix]
        )
        return x, y

    model = GPT(vocab, a.block_size, layers=2, width=64, heads=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95))
    scaler = torch.amp.GradScaler("cpu", enabled=False)

    @torch.no_grad()
    def estimate_loss() -> dict[str, float]:
        model.eval()
        res = {}
        for split in ("train", "val"):
            losses = torch.zeros(a.eval_iters)
            for k in range(a.eval_iters):
                X, Y = get_batch(split)
                _, loss = model(X, Y)
                losses[k] = loss.item()
            res[split] = losses.mean().item()
        model.train()
        return res

    tokens_per_step = []
    eval_seconds = 0.0
    X, Y = get_batch("train")
    t0 = time.perf_counter()
    for it in range(a.max_iters):
        if it == 1:  # the first iteration warms up (first kernels, allocations): left out
            t0 = time.perf_counter()
        lr = 6e-4 * 0.5 * (1 + math.cos(math.pi * it / a.max_iters))
        for g in optimizer.param_groups:
            g["lr"] = lr
        if a.eval_interval and it % a.eval_interval == 0 and it > 0:
            t = time.perf_counter()
            losses = estimate_loss()
            eval_seconds += time.perf_counter() - t
            print(f"step {it}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            torch.save({"model": model.state_dict(), "iter_num": it}, out / "ckpt.pt")
        n = 0
        for _ in range(a.grad_accum):
            _, loss = model(X, Y)
            loss = loss / a.grad_accum
            n += int((Y >= 0).sum())
            X, Y = get_batch("train")  # the next batch, fetched while... (on a GPU, async)
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        tokens_per_step.append(n)
        if it % 10 == 0:
            print(f"iter {it}: loss {loss.item() * a.grad_accum:.4f}")
    seconds = time.perf_counter() - t0
    if a.truth:
        Path(a.truth).write_text(
            json.dumps(
                {
                    "tokens_per_step": tokens_per_step,
                    "steps": a.max_iters,
                    "seconds": seconds,
                    "eval_seconds": eval_seconds,
                }
            )
        )


if __name__ == "__main__":
    main()
