"""A plain PyTorch training loop, shaped like many hand-written ones (pitstop only lends it text).

Tokenizes in `Dataset.__getitem__`, batch size 1, `num_workers=0`, AdamW, a log line every
few steps. `--sleep S` makes each `__getitem__` slower by S seconds (a slow
preprocessing step); `--workers N` is the usual fix. `--pretokenize` tokenizes every text once,
before training, so `__getitem__` only hands back tensors: a loop with no data cost left, which
loader workers cannot speed up. Profile it with

    pitstop profile --output runs/slow -- python examples/custom_loop.py MODEL_DIR --sleep 0.2

(MODEL_DIR: any local causal-LM directory; `pitstop.tiny.build_model_dir(DIR)` builds a tiny one.)
"""

import argparse
import time

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from pitstop.core.corpus import sample_texts


class TextDataset(Dataset):
    def __init__(self, texts, tokenizer, max_len, sleep_s, pretokenize=False):
        self.texts, self.tok, self.max_len, self.sleep_s = texts, tokenizer, max_len, sleep_s
        self.items = [self._encode(t) for t in texts] if pretokenize else None

    def __len__(self):
        return len(self.texts)

    def _encode(self, text):
        enc = self.tok(text, truncation=True, max_length=self.max_len, return_tensors="pt")
        ids = enc["input_ids"][0]
        return {"input_ids": ids, "attention_mask": enc["attention_mask"][0], "labels": ids.clone()}

    def __getitem__(self, i):
        if self.sleep_s:
            time.sleep(self.sleep_s)  # stands for slow preprocessing (augmentation, decoding...)
        if self.items is not None:
            return self.items[i]  # collate copies it into a new batch: the model sees a copy
        return self._encode(self.texts[i])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--max-len", type=int, default=64)
    ap.add_argument("--pretokenize", action="store_true")
    a = ap.parse_args()
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model)
    data = TextDataset(sample_texts(a.steps), tok, a.max_len, a.sleep, a.pretokenize)
    loader = DataLoader(data, batch_size=1, shuffle=True, num_workers=a.workers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    step = 0
    while step < a.steps:
        for batch in loader:
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            step += 1
            if step % 4 == 0:
                print(f"step {step} loss {loss.item():.3f}")
            if step == a.steps:
                break


if __name__ == "__main__":
    main()
