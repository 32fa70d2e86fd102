"""Held-out evaluation: `--eval-data FILE_OR_STORE|auto` with `--eval-steps N`.

The eval set is batched exactly like training (same strategy, row length, step size
and micro-batch split, plan of epoch 0 with the run's seed): packed rows restart
their position ids at every document, so documents never attend to each other and
a sequence's loss does not depend on what it was packed with. The loss is the
summed token cross-entropy over every eval target divided by the number of eval
targets (over all ranks), i.e. the mean CE per target token, and the perplexity is
exp(loss). Each rank evaluates its round-robin share of the rows; the two sums are
all-reduced.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from pitstop.batching.plan import build_plan, step_micro_batches
from pitstop.core.errors import ConfigError
from pitstop.core.run_record import EvalRecord
from pitstop.probe import Choice

__all__ = ["EvalResult", "EvalSet"]


EvalResult = EvalRecord  # its home is the run record (summary.json's `eval`)


class EvalSet:
    """This rank's eval micro-batches (specs computed once; tokens read at each evaluation)."""

    def __init__(
        self,
        store: Any,
        settings: Any,
        *,
        indices: np.ndarray | None,
        rank: int,
        seed: int,
        lockstep: bool,
        source: str,
    ) -> None:
        from pitstop.batching.loader import sequence_targets

        self.store = store
        self.source = source
        lengths = np.asarray(store.lengths, dtype=np.int64)
        ids = np.arange(len(lengths)) if indices is None else np.asarray(indices, np.int64)
        if len(ids) == 0:
            raise ConfigError(f"--eval-data {source}: no sequences to evaluate on")
        longest = int(lengths[ids].max())
        if longest > settings.max_seq_len:
            raise ConfigError(
                f"--eval-data {source} holds sequences of {longest} tokens, above --max-seq-len "
                f"{settings.max_seq_len}; prepare it with --max-seq-len {settings.max_seq_len}"
            )
        plan = build_plan(
            lengths,
            strategy=settings.strategy,
            max_seq_len=settings.max_seq_len,
            tokens_per_step=settings.tokens_per_step,
            seed=seed,
            epoch=0,
            indices=indices,
        )
        self.specs = [
            spec
            for step in range(plan.n_steps)
            for spec in step_micro_batches(plan, step, settings, rank, lockstep=lockstep)
        ]
        self.n_sequences = len(ids)
        self.n_targets = int(sequence_targets(store)[ids].sum())  # over all ranks
        if self.n_targets == 0:
            raise ConfigError(f"--eval-data {source}: its sequences hold no loss targets")
        self.pad_id = store.pad_id

    def choice(self, eval_steps: int | None) -> Choice:
        """The banner's and summary's account of the run's evaluation."""
        every = f"every {eval_steps} steps and " if eval_steps else ""
        return Choice(
            self.source,
            f"held-out loss and perplexity {every}at the end, over {self.n_targets:,} "
            "targets, batched like training; the checkpoint with the lowest eval loss is kept "
            "beside the newest (checkpoints/best.json)",
        )

    def batches(self) -> Iterator[dict[str, Any]]:
        """Micro-batch dicts (CPU tensors), as the training loader collates them."""
        from pitstop.batching.collate import collate

        s = self.store
        if hasattr(s, "verified"):  # a background checksum check ends first
            s.verified()
        for spec in self.specs:
            yield collate(s.tokens, s.mask, s.offsets, spec, self.pad_id)

    def result(self, loss_sum: float, step: int, seconds: float) -> EvalResult:
        """The eval record: `eval_loss` (mean CE per target), `eval_ppl` = exp(eval_loss)."""
        loss = loss_sum / self.n_targets
        return EvalResult(
            step=step,
            eval_loss=loss,
            eval_ppl=math.exp(loss) if loss < 700 else float("inf"),
            eval_targets=self.n_targets,
            eval_sequences=self.n_sequences,
            eval_seconds=seconds,
        )


def held_out_loss(
    eval_set: EvalSet,
    model: Any,
    loss_sum: Callable[[dict[str, Any]], Any],
    *,
    step: int,
    device: Any,
    all_reduce: Callable[[Any], Any],
) -> EvalResult:
    """Evaluate `model` on `eval_set` now: `loss_sum(micro_batch)` is a device scalar.

    In eval mode (no dropout), without gradients; all ranks take part (`all_reduce`
    sums over them). The model goes back to the mode it was in.
    """
    import torch

    t0 = time.perf_counter()
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    try:
        with torch.no_grad():
            for mb in eval_set.batches():
                total += loss_sum(mb).double()
    finally:
        model.train(was_training)
    all_reduce(total)
    return eval_set.result(float(total.item()), step, time.perf_counter() - t0)
