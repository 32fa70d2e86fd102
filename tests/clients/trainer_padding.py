"""A Hugging Face Trainer script whose collator pads, for pitstop's real-client tests.

As the transformers examples write one: texts tokenized up front, a
`DataCollatorForLanguageModeling(mlm=False)` that pads each batch to its longest row,
`Trainer(model, TrainingArguments(...), train_dataset=..., data_collator=...)`. A callback
counts the padding of the batches the model trained on (attention-mask zeros over
positions), and `--truth FILE` holds it with the optimizer steps.

    python tests/clients/trainer_padding.py MODEL_DIR OUTPUT_DIR [--steps 12] [--truth FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    Trainer,
    TrainingArguments,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import texts, write_truth


class CountingCollator:
    """The collator, counting the padding of every batch it makes."""

    def __init__(self, inner: DataCollatorForLanguageModeling) -> None:
        self.inner, self.pad, self.positions = inner, 0, 0

    def __call__(self, rows: list) -> dict:
        batch = self.inner(rows)
        self.pad += int((batch["attention_mask"] == 0).sum())
        self.positions += int(batch["attention_mask"].numel())
        return batch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("output_dir")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--truth", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(a.model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    rows = [tok(t, truncation=True, max_length=256) for t in texts(a.steps * 8)]
    collator = CountingCollator(DataCollatorForLanguageModeling(tok, mlm=False))
    args = TrainingArguments(
        output_dir=a.output_dir,
        per_device_train_batch_size=8,
        max_steps=a.steps,
        learning_rate=1e-3,
        logging_steps=4,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        dataloader_pin_memory=False,
    )
    model = AutoModelForCausalLM.from_pretrained(a.model)
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=collator)
    trainer.train()
    write_truth(
        a.truth,
        steps=trainer.state.global_step,
        padding_share=collator.pad / collator.positions,
    )


if __name__ == "__main__":
    main()
