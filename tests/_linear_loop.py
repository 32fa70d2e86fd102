"""A tiny plain-PyTorch loop for `pitstop profile -- ...` tests (no transformers model).

Usage: python tests/_linear_loop.py [--steps N] [--sleep S] [--save-every N] [--gc-every N]
[--tf32]; under torchrun each rank trains its own copy (no DDP: the launcher form is what is
tested). --save-every / --gc-every: torch.save (to memory) / gc.collect() and
torch.cuda.empty_cache() every N steps; --tf32: set torch.backends.cuda.matmul.allow_tf32.
"""

import argparse
import gc
import io
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Tokens(Dataset):
    def __init__(self, n, sleep_s):
        self.n, self.sleep_s = n, sleep_s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        ids = torch.arange(i, i + 16) % 50
        return {"input_ids": ids, "labels": ids.roll(-1)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--save-every", type=int, default=0)
    ap.add_argument("--gc-every", type=int, default=0)
    ap.add_argument("--tf32", action="store_true")
    a = ap.parse_args()
    if a.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 32), nn.Linear(32, 50))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(Tokens(a.steps * 2, a.sleep), batch_size=2)
    for step, batch in enumerate(loader, 1):
        logits = model(batch["input_ids"])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if a.save_every and step % a.save_every == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, io.BytesIO())
        if a.gc_every and step % a.gc_every == 0:
            gc.collect()
            torch.cuda.empty_cache()
        if step == a.steps:
            break


if __name__ == "__main__":
    main()
