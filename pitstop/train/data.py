"""Where the trainer's batches come from: the token store and pitstop.batching's loader.

The loader contract is the `pitstop.batching.loader.Loader` protocol: iterating yields
micro-batch dicts {input_ids Long[B,T], labels Long[B,T] (-100 = not a target; the
model shifts), position_ids Long[B,T] (restarting at 0 per packed document), cu_seqlens
Int32[n+1], max_seqlen int, meta `pitstop.batching.records.MicroBatchMeta`} up to the
end of the run. The trainer accepts any object honouring it (tests pass small ones).
The batch shape is decided in pitstop.batching.resolve.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pitstop.batching.loader import MicroBatchLoader
from pitstop.batching.resolve import (
    BatchRequest,
    loader_options,
    resolve_batch_shape,
)
from pitstop.batching.split import holdout_split
from pitstop.core import log, run_record
from pitstop.core.config import RunConfig
from pitstop.core.errors import ConfigError
from pitstop.core.run_record import PlannedEfficiency
from pitstop.data.prepare import open_store
from pitstop.data.stats import eos_only_message, slow_records_message
from pitstop.data.store import check_vocab
from pitstop.probe import Choice


@dataclass
class Geometry:
    """The shape of the training math, for the banner and FLOPs/compile estimates."""

    strategy: str
    max_seq_len: int
    tokens_per_step: int
    micro: str  # how a step is split into micro-batches, in words
    choices: dict[str, Choice] = field(default_factory=dict)
    efficiency: PlannedEfficiency | None = None
    measured: Any = None  # pitstop.batching.choices.MeasuredChoices of `auto`, else None
    # Epoch 0's mean attention span per position (plan.Efficiency.attention_span): None
    # where the documents' lengths are unknown (a loader given by the caller).
    attention_span: float | None = None

    @property
    def flops_seq_len(self) -> float:
        """The T of the FLOPs formula's 12·L·d·T (cost_model.FlopsModel.per_token): the
        positions each position attends over. Packed rows of short documents attend over
        their documents, not max_seq_len, whatever the kernel: a kernel that computes the
        whole row under a document mask discards the rest, which no model needs (as the
        recomputation of gradient checkpointing is not model FLOPs either)."""
        return self.attention_span or float(self.max_seq_len)


def open_training_store(cfg: RunConfig) -> Any:

    store = open_store(cfg)
    check_vocab(store, cfg.model)  # an id past the embedding fails mid-step otherwise
    check_targets(store, cfg)
    slow = slow_records_message(store.manifest.get("stats") or {})
    if slow:
        log.warning(f"pitstop: warning: {slow}")
    return store


def check_targets(store: Any, cfg: RunConfig) -> None:
    """Refuse a store whose every record carries no loss target but its end-of-sequence
    token (a run would "complete" having learnt only to stop: typically role names or a
    field option that do not match the data); warn when a share of them do
    (pitstop.data.stats.EOS_ONLY_WARN_SHARE). Before the output directory is written."""

    stats = store.manifest.get("stats") or {}
    info = store.eos_only_documents()
    msg = eos_only_message(info, stats)
    if not msg:
        return
    if info["count"] == info["of"]:
        data = ", ".join(map(str, cfg.data)) or store.path
        raise ConfigError(
            f"nothing to train on in {data}: {msg}. Nothing was written to {cfg.output}; "
            "fix the data or the options, and prepare it again"
        )
    log.warning(f"pitstop: warning: {msg}")


def saved_strategy(out: Path) -> str | None:
    """The batching strategy of the newest checkpoint in `out` (a resumed `auto` run keeps it)."""

    from pitstop.train.checkpoint import latest_checkpoint, read_loader_state

    ck = latest_checkpoint(out / run_record.CHECKPOINTS)
    try:
        state = read_loader_state(ck) if ck is not None else None
    except (OSError, ValueError, pickle.UnpicklingError):
        return None  # a damaged or planted file: resume's own load refuses it by name
    return state.get("strategy") if isinstance(state, dict) else None


def build_loader(req: BatchRequest) -> tuple[MicroBatchLoader, Geometry]:
    """The run's MicroBatchLoader, with the batch shape pitstop.batching.resolve decided
    (`batching: auto` and the device-sized micro-batch: measured once and reused)."""
    shape = resolve_batch_shape(req)
    loader = MicroBatchLoader(
        req.store,
        shape.settings,
        loader_options(req.cfg),
        rank=req.rank,
        indices=req.indices,
        lockstep=req.lockstep,
    )
    s = shape.settings
    choices = {
        "batching": shape.choices["batching"],
        "loader_workers": Choice(loader.num_workers, loader.choices["loader_workers"]),
        "pin_memory": Choice(loader.pin_memory, loader.choices["pin_memory"]),
    }
    micro = (
        f"{s.micro_batch_size} rows per micro-batch"
        if s.micro_batch_size is not None
        else f"micro-batches of up to {s.tokens_per_micro_batch:,} positions"
    )
    eff = loader.efficiency(0)
    efficiency = PlannedEfficiency(
        packing_efficiency=float(eff.packing_efficiency), padding_waste=float(eff.padding_waste)
    )
    if "micro_batch" in shape.choices:
        choices["micro_batch"] = shape.choices["micro_batch"]
    geo = Geometry(s.strategy, s.max_seq_len, s.tokens_per_step, micro, choices, efficiency)
    geo.measured = shape.measured
    geo.attention_span = eff.attention_span
    return loader, geo


@dataclass
class EvalData:
    """Where held-out evaluation reads: a store and the sequence ids to evaluate."""

    store: Any
    indices: Any  # int64 sequence ids, or None for the whole store
    train_indices: Any  # what training keeps (None: the whole training store)
    source: str  # for the banner and summary


def eval_data(cfg: RunConfig, train_store: Any) -> EvalData | None:
    """`--eval-data`: None when off; `auto` splits `train_store`, else the file is prepared.

    A file goes through the same cache as the training data (`open_store(cfg, data=[path])`),
    so it is tokenized once, with the run's template, masking and max length.
    """
    if not cfg.eval_data:
        return None
    if cfg.eval_data == "auto":
        split = holdout_split(np.asarray(train_store.doc_ids))
        return EvalData(train_store, split.eval, split.train, split.describe())

    store = open_store(cfg, data=[cfg.eval_data], progress=False)
    return EvalData(store, None, None, f"{cfg.eval_data} ({len(store.lengths)} sequences)")
