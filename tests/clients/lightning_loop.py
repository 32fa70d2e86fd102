"""A PyTorch Lightning training script, for pitstop's real-client tests (tests/test_clients_*).

As Lightning's documentation writes one: a `LightningModule` wrapping a causal LM
(`training_step` returns the loss, `validation_step` logs one, `configure_optimizers`
returns AdamW), automatic optimization (Lightning runs forward and backward inside
`optimizer.step(closure)`), and `L.Trainer(max_steps=..., val_check_interval=...,
limit_val_batches=...)`.

`--truth FILE`: the optimizer steps, the seconds of `trainer.fit` after the first training
batch (a warm-up), and the seconds of validation in them (Lightning's own hooks).

    python tests/clients/lightning_loop.py MODEL_DIR [--steps 30] [--val-every 10]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import texts, write_truth


class Clock(L.Callback):
    """The seconds from the end of the first training batch (a warm-up) to the end of fit,
    and the seconds of the validation loops in them (Lightning's own hooks)."""

    def __init__(self) -> None:
        self.t0: float | None = None
        self.val_seconds = 0.0
        self._val_t0 = 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.t0 is None:
            self.t0 = time.perf_counter()

    def on_validation_start(self, trainer, pl_module) -> None:
        self._val_t0 = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        if self.t0 is not None:
            self.val_seconds += time.perf_counter() - self._val_t0


class LitLM(L.LightningModule):
    def __init__(self, model_dir: str) -> None:
        super().__init__()
        self.model = AutoModelForCausalLM.from_pretrained(model_dir)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.log("val_loss", self.model(**batch).loss)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def loader(tok, n: int, seed: int, block: int) -> DataLoader:
    ids = tok(" ".join(texts(n, seed)))["input_ids"]
    rows = [ids[i : i + block] for i in range(0, len(ids) - block, block)]
    data = [{"input_ids": torch.tensor(r), "labels": torch.tensor(r)} for r in rows]
    return DataLoader(data, batch_size=4, shuffle=seed == 0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--val-every", type=int, default=10, help="0: no validation")
    ap.add_argument("--val-batches", type=int, default=8)
    ap.add_argument("--truth", default=None)
    a = ap.parse_args()
    L.seed_everything(0, verbose=False)
    tok = AutoTokenizer.from_pretrained(a.model)
    train = loader(tok, 400, 0, 64)
    val = loader(tok, 100, 1, 64)
    trainer = L.Trainer(
        max_steps=a.steps,
        val_check_interval=a.val_every or None,
        limit_val_batches=a.val_batches if a.val_every else 0,
        num_sanity_val_steps=0,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    clock = Clock()
    trainer.callbacks.append(clock)
    trainer.fit(LitLM(a.model), train, val if a.val_every else None)
    write_truth(
        a.truth,
        steps=trainer.global_step,
        seconds=time.perf_counter() - clock.t0,
        val_seconds=clock.val_seconds,
    )


if __name__ == "__main__":
    main()
