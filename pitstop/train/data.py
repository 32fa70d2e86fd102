"""Where the trainer's batches come from: the token store and the batching loader.

The agreed loader contract (pitstop/batching): iterating yields micro-batch dicts
{input_ids Long[B,T], labels Long[B,T] (-100 = not a target; the model shifts),
position_ids Long[B,T] (restarting at 0 per packed document), cu_seqlens Int32[n+1],
max_seqlen int, meta {epoch, step, micro_index, micro_count, n_positions, n_seen,
n_targets, step_targets}}, with `state_dict()` / `load_state_dict()` for exact
resume and `steps_per_epoch` known up front.

`SimplePackLoader` implements that contract with plain greedy packing. It is what
the trainer uses when pitstop.batching does not provide a loader (and what unit
tests use to stay independent of it).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from pitstop.data.store import TokenStore


def default_geometry(
    *,
    max_seq_len: int,
    tokens_per_step: int | None,
    micro_batch_size: int | None,
    grad_accum: int | None,
) -> tuple[int, int, int]:
    """(rows per micro-batch, micro-batches per step, tokens per step).

    Tokens per optimizer step is the unit of the training math: given, it fixes the
    accumulation; otherwise micro-batch rows x accumulation x max length; with
    neither, 8 rows' worth.
    """
    mbs = micro_batch_size
    if tokens_per_step is not None:
        rows = max(1, tokens_per_step // max_seq_len)
        mbs = min(mbs or rows, rows)
        accum = max(1, rows // mbs)
        return mbs, accum, tokens_per_step
    mbs = mbs or (8 if grad_accum is None else 1)
    accum = grad_accum or max(1, 8 // mbs)
    return mbs, accum, mbs * accum * max_seq_len


class SimplePackLoader:
    """Greedy packing of store sequences into rows of `max_seq_len`, shuffled per epoch.

    Documents never attend to each other (position ids restart per document; the
    model builds a block-diagonal mask from them). Deterministic from (seed, epoch);
    its state is the position (epoch, step), so resuming replays nothing.
    """

    def __init__(
        self,
        store: TokenStore,
        *,
        max_seq_len: int,
        micro_batch_size: int,
        grad_accum: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
    ) -> None:
        self.store = store
        self.max_seq_len = max_seq_len
        self.micro_batch_size = micro_batch_size
        self.grad_accum = grad_accum
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.epoch = 0
        self.step = 0  # optimizer steps already yielded in this epoch
        rows_per_step = micro_batch_size * grad_accum * world_size
        self._rows_cache: dict[int, list[list[int]]] = {}
        self.steps_per_epoch = len(self._rows(0)) // rows_per_step
        if self.steps_per_epoch == 0:
            n = len(self._rows(0))
            raise ValueError(f"the data makes {n} rows, fewer than one optimizer step ({rows_per_step})")

    def _rows(self, epoch: int) -> list[list[int]]:
        """Sequence indices of each packed row for `epoch` (first fit, in shuffled order)."""
        if epoch in self._rows_cache:
            return self._rows_cache[epoch]
        lengths = self.store.lengths
        order = np.arange(len(lengths))
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(lengths))
        rows: list[list[int]] = []
        fill: list[int] = []
        for i in order:
            n = int(lengths[i])
            for r, used in enumerate(fill):  # first fit over the few open rows
                if used + n <= self.max_seq_len:
                    rows[r].append(int(i))
                    fill[r] += n
                    break
            else:
                rows.append([int(i)])
                fill.append(n)
            if len(fill) > 16:  # close the fullest rows: bounded work per sequence
                r = int(np.argmax(fill))
                fill[r] = self.max_seq_len + 1
        self._rows_cache = {epoch: rows}
        return rows

    def _micro(self, seqs_per_row: list[list[int]], meta: dict[str, Any]) -> dict[str, Any]:
        b, t = len(seqs_per_row), self.max_seq_len
        ids = torch.full((b, t), 0, dtype=torch.long)
        labels = torch.full((b, t), -100, dtype=torch.long)
        pos = torch.zeros((b, t), dtype=torch.long)
        cu = [0]
        n_seen = 0
        for r, seqs in enumerate(seqs_per_row):
            at = 0
            for i in seqs:
                tok, mask = self.store.sequence(i)
                n = len(tok)
                ids[r, at : at + n] = torch.from_numpy(tok)
                lab = np.where(mask, tok, -100)
                lab[0] = -100  # nothing before a sequence in this row may predict its first token
                labels[r, at : at + n] = torch.from_numpy(lab)
                pos[r, at : at + n] = torch.arange(n)
                at += n
                cu.append(r * t + at)
            n_seen += at
            if at < t:  # padding: its own "document" so it attends to nothing real
                pos[r, at:] = torch.arange(t - at)
                cu.append((r + 1) * t)
        n_targets = int((labels[:, 1:] != -100).sum())
        meta = {**meta, "n_positions": b * t, "n_seen": n_seen, "n_targets": n_targets}
        return {
            "input_ids": ids,
            "labels": labels,
            "position_ids": pos,
            "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
            "max_seqlen": t,
            "meta": meta,
        }

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while True:
            rows = self._rows(self.epoch)
            per_step = self.micro_batch_size * self.grad_accum * self.world_size
            while self.step < self.steps_per_epoch:
                step_rows = rows[self.step * per_step : (self.step + 1) * per_step]
                mine = step_rows[self.rank :: self.world_size]
                micro_rows = [
                    mine[m * self.micro_batch_size : (m + 1) * self.micro_batch_size]
                    for m in range(self.grad_accum)
                ]
                micros = []
                for m, mr in enumerate(micro_rows):
                    meta = {"epoch": self.epoch, "step": self.step, "micro_index": m,
                            "micro_count": self.grad_accum}  # fmt: skip
                    micros.append(self._micro(mr, meta))
                # step_targets counts every rank's targets; one process here computes all.
                all_targets = sum(
                    int(np.asarray(self._targets_of(r)).sum()) for r in step_rows
                )
                self.step += 1
                for mb in micros:
                    mb["meta"]["step_targets"] = all_targets
                    yield mb
            self.epoch += 1
            self.step = 0

    def _targets_of(self, seqs: list[int]) -> list[int]:
        out = []
        for i in seqs:
            _, mask = self.store.sequence(i)
            out.append(int(mask[1:].sum()))  # a row-initial token is never a target
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "step": self.step, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.step = int(state["epoch"]), int(state["step"])


def steps_for(cfg_epochs: float | None, max_steps: int | None, steps_per_epoch: int) -> int:
    """Total optimizer steps of the run: --max-steps, else epochs x steps per epoch."""
    if max_steps is not None:
        return max_steps
    return max(1, math.floor((cfg_epochs or 1.0) * steps_per_epoch))
