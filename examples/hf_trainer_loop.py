"""A Hugging Face Trainer script shaped like many first fine-tunes (pitstop only lends it text).

fp32, `dataloader_num_workers=0`, gradient checkpointing on although a small model fits,
micro-batch 2 x accumulation 2, a checkpoint every few steps into `--output-dir` and a
trainer.save_model() at the end. `--sleep S` makes each example S seconds slower to build
(tokenizing in `__getitem__`). Measure what each fix is worth with

    pitstop tune -- python examples/hf_trainer_loop.py MODEL_DIR --output-dir runs/my-finetune

(MODEL_DIR: any local causal-LM directory; `pitstop.tiny.build_model_dir(DIR)` builds a tiny
one). The trials never write into --output-dir: pitstop points output_dir at each trial.
"""

import argparse
import time

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    Trainer,
    TrainingArguments,
)

from pitstop.core.corpus import sample_texts


class TextDataset(torch.utils.data.Dataset):
    def __init__(self, texts, tokenizer, max_len, sleep_s):
        self.texts, self.tok, self.max_len, self.sleep_s = texts, tokenizer, max_len, sleep_s

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        if self.sleep_s:
            time.sleep(self.sleep_s)  # stands for slow preprocessing
        return self.tok(self.texts[i], truncation=True, max_length=self.max_len)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--output-dir", default="runs/hf-finetune")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--max-len", type=int, default=64)
    a = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(a.model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(a.model)
    args = TrainingArguments(
        output_dir=a.output_dir,
        max_steps=a.steps,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        gradient_checkpointing=True,
        dataloader_num_workers=0,
        save_strategy="steps",
        save_steps=5,
        logging_steps=5,
        report_to="none",
        use_cpu=True,
        seed=0,
    )
    data = TextDataset(sample_texts(4 * a.steps), tok, a.max_len, a.sleep)
    collator = DataCollatorForLanguageModeling(tok, mlm=False)
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collator)
    trainer.train()
    trainer.save_model(a.output_dir)


if __name__ == "__main__":
    main()
