"""The typed records that travel with each micro-batch from the loader to the trainer.

`MicroBatch` is the host micro-batch a loader yields (a dict, so DataLoader workers,
pinning and `default_collate`-style code handle it). `MicroBatchLoader` puts one
`MicroBatchMeta` under every micro-batch's "meta" key (a plain frozen dataclass of ints:
it pickles from loader workers and pinning leaves it alone). The trainer reads its fields
to count tokens and to know where a step ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Required, TypedDict

if TYPE_CHECKING:
    import torch


class MicroBatch(TypedDict, total=False):
    """A host micro-batch (batching/collate.py builds it; conventions there). A loader of
    its own (`pitstop.batching.loader.Loader`) must give the three [B, T] tensors; the
    segment facts are derived from `position_ids` when missing (train/attention.py)."""

    input_ids: Required[torch.Tensor]  # int64 [B, T]
    labels: Required[torch.Tensor]  # int64 [B, T], -100 where no target
    position_ids: Required[torch.Tensor]  # int64 [B, T], restarting at every document
    cu_seqlens: torch.Tensor  # int32 [segments + 1] over the flattened [B*T] batch
    max_seqlen: int
    meta: MicroBatchMeta


@dataclass(frozen=True)
class MicroBatchMeta:
    """Where a micro-batch sits in the run and what it holds (counts for this rank).

    `step` counts optimizer steps from the start of the run, `epoch_step` from the start
    of `epoch` (None from a caller's loader that does not know it: the trainer then
    assumes epochs of steps_per_epoch steps). `step_targets` is the step's target count
    over all ranks: the divisor that makes accumulated micro-batches one batch's mean.
    """

    epoch: int
    step: int
    micro_index: int
    micro_count: int
    n_positions: int  # all positions computed, padding included
    n_seen: int  # non-padding input tokens
    n_targets: int  # tokens that contribute to the loss
    step_targets: int
    epoch_step: int | None = None
    filler: bool = False  # a padding-only micro-batch that keeps ranks in lockstep

    @property
    def last_of_step(self) -> bool:
        return self.micro_index == self.micro_count - 1
