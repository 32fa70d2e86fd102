"""A plain loop whose step allocates 32 MiB tensors (logits of 2,048 positions over a 4,096
vocabulary) for `pitstop profile -- ...` tests of the host-page-faults finding: under glibc's
defaults each is handed back to the OS when freed and faulted in again the next step.

Usage: python examples/faulting_loop.py [--steps N]
(tests/test_host_malloc.py and `python -m bench.host_malloc` profile it.)
"""

import argparse

import torch
from torch import nn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(4096, 64), nn.Linear(64, 4096))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(a.steps):
        x = torch.randint(0, 4096, (4, 512))
        logits = model(x)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), x.roll(-1, 1).flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()


if __name__ == "__main__":
    main()
