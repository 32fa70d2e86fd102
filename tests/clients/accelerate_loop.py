"""An accelerate training loop, for pitstop's real-client tests (tests/test_clients_*).

As accelerate's documentation writes one: `Accelerator(gradient_accumulation_steps=2)`,
`accelerator.prepare(model, optimizer, loader)`, `with accelerator.accumulate(model):`
around each micro-batch, `accelerator.backward(loss)`, and a
`DataCollatorForLanguageModeling` that pads each batch to its longest row.

`--truth FILE`: the optimizer steps, and the padding share of the batches the model trained
on (attention-mask zeros over positions, counted from the batches themselves).

    python tests/clients/accelerate_loop.py MODEL_DIR [--steps 20] [--truth FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import texts, write_truth


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--truth", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)
    tok = AutoTokenizer.from_pretrained(a.model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    rows = [tok(t, truncation=True, max_length=256) for t in texts(a.steps * 2 * a.batch_size)]
    collate = DataCollatorForLanguageModeling(tok, mlm=False)
    loader = DataLoader(rows, batch_size=a.batch_size, shuffle=True, collate_fn=collate)
    model = AutoModelForCausalLM.from_pretrained(a.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    steps, pad, positions = 0, 0, 0
    for batch in loader:
        with accelerator.accumulate(model):
            out = model(**batch)
            accelerator.backward(out.loss)
            optimizer.step()
            optimizer.zero_grad()
        pad += int((batch["attention_mask"] == 0).sum())
        positions += int(batch["attention_mask"].numel())
        if accelerator.sync_gradients:
            steps += 1
            if steps == a.steps:
                break
    write_truth(a.truth, steps=steps, padding_share=pad / positions)


if __name__ == "__main__":
    main()
