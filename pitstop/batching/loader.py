"""`MicroBatchLoader`: the run's micro-batches, read from the memory-mapped token store.

Built on torch's DataLoader (``batch_size=None`` over a map-style dataset) so worker
processes, pinning and prefetching are torch's. The sampler runs in the main process
and yields *keys* that already name the sequence ids of every row, so workers only
read and collate: no plan is rebuilt in a worker and no tokenizer is involved.

Position and resume: the loader counts what it has *handed to the caller*, not what
workers have prefetched. `state_dict()` after the last micro-batch of step k says
"next: step k+1"; after a partial step it says "that step again from its first
micro-batch". Because every epoch's plan is a pure function of (seed, epoch, lengths,
trained tokens, strategy, max_seq_len, tokens_per_step), the state is just two ints,
and a resumed run continues with exactly the next batch, even with a different
micro-batch size or world size (those never change step composition; the strategy
only arranges a step's documents, but it is kept so a resume repeats the same sums).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol, TypedDict

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from pitstop.batching import plan as plan_module
from pitstop.batching.collate import collate
from pitstop.batching.plan import (
    Efficiency,
    MicroBatchSpec,
    Plan,
    build_plan,
    plan_efficiency,
    release_step_plans,
    step_micro_batches,
)
from pitstop.batching.rank_plan import build_rank_plans
from pitstop.batching.records import MicroBatch, MicroBatchMeta
from pitstop.batching.settings import BatchSettings
from pitstop.core.errors import PitstopError
from pitstop.data.facts import sequence_facts
from pitstop.data.store import TokenStore

__all__ = [
    "Loader",
    "LoaderError",
    "LoaderOptions",
    "MicroBatchLoader",
    "default_loader_workers",
    "sequence_targets",
]

# Below this many tokens the whole store is a few MB: reading a micro-batch in the main
# process takes microseconds, and starting worker processes would cost more than it saves.
TINY_STORE_TOKENS = 2_000_000


class LoaderError(PitstopError):
    """Batches could not be produced (a worker died, or the store does not fit the run)."""

    exit_code = 1


def default_loader_workers(n_tokens: int, cpu_count: int | None = None) -> tuple[int, str]:
    """(workers, reason): 0 for tiny data, else min(4, cores - 1) so the main process keeps a core."""
    cores = cpu_count or os.cpu_count() or 1
    if n_tokens < TINY_STORE_TOKENS:
        return 0, f"the store is {n_tokens:,} tokens: reading in the main process is cheaper"
    n = max(0, min(4, cores - 1))
    return n, f"min(4, {cores} cores - 1): overlaps reading with compute"


def sequence_targets(store: TokenStore) -> np.ndarray:
    """Loss targets per sequence, int64 [n_sequences], never counting a sequence's first
    token: the store's stored facts (pitstop.data.facts), not a pass over its mask."""
    return np.asarray(sequence_facts(store).trained, dtype=np.int64)


class _Key(NamedTuple):
    """What the sampler sends a worker: everything needed to build one micro-batch."""

    epoch: int
    step: int  # global optimizer step index in the run
    epoch_step: int
    micro_index: int
    micro_count: int
    step_targets: int
    spec: MicroBatchSpec


class _MicroBatchDataset(Dataset):
    """Map-style dataset indexed by `_Key`; opens the store lazily in each process."""

    def __init__(self, store_path: Path, pad_id: int) -> None:
        self.store_path = store_path
        self.pad_id = pad_id
        self._store: TokenStore | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Never pickle memmaps into workers (that copies the data); each worker maps the files.
        return {**self.__dict__, "_store": None}

    def __getitem__(self, key: _Key) -> MicroBatch:
        if self._store is None:
            self._store = TokenStore(self.store_path)
        s = self._store
        batch = collate(s.tokens, s.mask, s.offsets, key.spec, self.pad_id)
        labels = batch["labels"]
        batch["meta"] = MicroBatchMeta(
            epoch=key.epoch,
            step=key.step,
            epoch_step=key.epoch_step,
            micro_index=key.micro_index,
            micro_count=key.micro_count,
            n_positions=int(labels.numel()),
            n_seen=_seen_tokens(s.offsets, key.spec),
            n_targets=int((labels != -100).sum()),
            step_targets=key.step_targets,
            filler=bool(key.spec.filler),
        )
        return batch


def _seen_tokens(offsets: np.ndarray, spec: MicroBatchSpec) -> int:
    if spec.filler:
        return 0
    seqs = np.concatenate(spec.rows)
    return int((np.asarray(offsets[seqs + 1]) - np.asarray(offsets[seqs])).sum())


def _identity(x: Any) -> Any:
    return x


class _KeySampler(Sampler):
    """Yields the keys from the loader's current position to the end of the run."""

    def __init__(self, loader: MicroBatchLoader) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[_Key]:
        return self.loader._keys(self.loader._next_step)


@dataclass(frozen=True)
class LoaderOptions:
    """The loader's own settings (pitstop.batching.resolve.loader_options reads them from a
    run's config): the plan's seed, the run's length, and how batches are fetched."""

    seed: int = 0
    epochs: float | None = None  # default 1 (a fraction rounds up); max_steps wins
    max_steps: int | None = None
    workers: int | None = None  # None: default_loader_workers
    pin_memory: bool = True  # on a CUDA machine (pinned host memory only helps copies to a GPU)
    prefetch_factor: int | None = None


class LoaderState(TypedDict, total=False):
    """`MicroBatchLoader.state_dict()`: a checkpoint's loader_state.json (plain JSON values).
    A checkpoint of an older version may lack `epoch_steps` (the epochs are planned again)."""

    global_step: int  # the next step to hand out
    epoch: int
    step: int  # within the epoch
    seed: int
    strategy: str  # the layout's name (a run may resume under another)
    max_seq_len: int
    tokens_per_step: int
    epoch_steps: list[int]  # steps of each epoch before `epoch`
    n_sequences: int  # which sequences the plans cover (the held-out split)
    n_tokens: int
    fill_chunk: int  # plan.FILL_CHUNK of the pitstop that planned it (absent before 2026-11-26)


class Loader(Protocol):
    """What the Trainer needs of a loader; MicroBatchLoader and the tests' loaders honour it.

    Iterating yields micro-batch dicts up to the end of the run (see MicroBatchLoader);
    `steps_in_epoch(e)` counts epoch e's optimizer steps; `state_dict()` /
    `load_state_dict()` resume exactly; `settings` is None for a loader that cannot
    `resplit` (then an out-of-memory is not backed off)."""

    settings: BatchSettings | None

    def __iter__(self) -> Iterator[MicroBatch]: ...

    @property
    def steps_per_epoch(self) -> int: ...

    @property
    def total_steps(self) -> int: ...

    def steps_in_epoch(self, epoch: int) -> int: ...

    def resplit(self, settings: BatchSettings) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class MicroBatchLoader:
    """Iterates the run's micro-batches for one rank, across epochs, resumably.

    Each item is a dict: ``input_ids``, ``labels``, ``position_ids`` (Long [B, T], CPU),
    ``cu_seqlens`` (Int32 [n_segments + 1]), ``max_seqlen`` (int) and ``meta`` (a
    `pitstop.batching.records.MicroBatchMeta`). Divide the summed loss of a micro-batch by
    ``meta.step_targets`` (the step's targets over all ranks) and sum gradients over
    micro-batches and ranks: that is the mean over the step with no extra communication.
    """

    def __init__(
        self,
        store: TokenStore | str | Path,
        settings: BatchSettings,
        options: LoaderOptions | None = None,
        *,
        rank: int = 0,
        pad_id: int | None = None,
        indices: np.ndarray | None = None,
        lockstep: bool = False,
    ) -> None:
        self.store = store if isinstance(store, TokenStore) else TokenStore(store)
        # `indices`: the sequence ids to train on (None: all); the rest (a held-out eval
        # share) never appears in a plan. `lockstep`: every rank gets as many micro-batches
        # per step (FSDP; see step_micro_batches).
        self.indices = None if indices is None else np.asarray(indices, dtype=np.int64)
        self.lockstep = lockstep
        self.settings = settings
        opts = options or LoaderOptions()
        if not 0 <= rank < self.settings.world_size:
            raise ValueError(f"rank {rank} outside world size {self.settings.world_size}")
        self.rank = rank
        self.seed = opts.seed
        # The store's uint32 facts, memory-mapped: no int64 copy held for the run (16 bytes
        # per document), and ranks on one machine share the pages.
        facts = sequence_facts(self.store)
        self.lengths, self.targets = facts.lengths, facts.trained
        used = self.lengths if self.indices is None else self.lengths[self.indices]
        problems = []
        if len(used) == 0:
            problems.append(
                f"the token store {self.store.path} holds no sequences to train on; prepare non-empty data"
            )
        elif int(used.max()) > self.settings.max_seq_len:
            problems.append(
                f"the token store {self.store.path} holds sequences of up to {int(used.max())} "
                f"tokens but max_seq_len is {self.settings.max_seq_len}; prepare it again with "
                f"--max-seq-len {self.settings.max_seq_len} or raise --max-seq-len"
            )
        if problems:
            raise LoaderError(problems)
        self.pad_id = pad_id if pad_id is not None else self.store.pad_id
        self.epochs = opts.epochs
        self.max_steps = opts.max_steps
        if opts.workers is not None:
            self.num_workers, why_workers = opts.workers, "set"
        else:
            self.num_workers, why_workers = default_loader_workers(self.store.n_tokens)
        cuda = torch.cuda.is_available()
        self.pin_memory = cuda and opts.pin_memory
        if self.pin_memory:
            why_pin = "CUDA available"
        elif not cuda:
            why_pin = "no CUDA: pinned host memory only helps copies to a GPU"
        else:
            why_pin = "set"
        self.prefetch_factor = opts.prefetch_factor
        # Reasons shown in the run banner beside each value (the value is not repeated).
        self.choices = {
            "batching": self.settings.reason or "set",
            "loader_workers": why_workers,
            "pin_memory": why_pin,
        }
        self._plans: dict[int, Plan] = {}
        self._epoch_steps: list[int] = []  # steps of epochs 0, 1, ... as far as computed
        self._step_targets: dict[int, np.ndarray] = {}
        self._next_step = 0  # global index of the first step not fully handed out
        self._dataset = _MicroBatchDataset(self.store.path, self.pad_id)
        self._dataloader: DataLoader | None = None

    # --- the plan ---------------------------------------------------------------
    def plan(self, epoch: int) -> Plan:
        """The plan of `epoch` (the two most recent are cached)."""
        if epoch not in self._plans:
            self._plans[epoch] = self._build(epoch)
            for old in [e for e in self._plans if e not in (epoch, epoch - 1)]:
                del self._plans[old]
                self._step_targets.pop(old, None)
        return self._plans[epoch]

    def _build(self, epoch: int) -> Plan:
        s = self.settings
        if s.world_size > 1:  # this rank's share only (rank_plan)
            plan = build_rank_plans(
                self.lengths,
                settings={s.strategy: s},
                seed=self.seed,
                epoch=epoch,
                rank=self.rank,
                indices=self.indices,
                trained=self.targets,
                lockstep=self.lockstep,
            )[s.strategy]
        else:
            plan = build_plan(
                self.lengths,
                strategy=s.strategy,
                max_seq_len=s.max_seq_len,
                tokens_per_step=s.tokens_per_step,
                seed=self.seed,
                epoch=epoch,
                indices=self.indices,
                trained=self.targets,
            )
        release_step_plans()  # the layouts `auto` compared are done with it (16 B/doc)
        return plan

    def steps_in_epoch(self, epoch: int) -> int:
        """Optimizer steps of `epoch` (bucket and pad may differ by a step between epochs)."""
        while len(self._epoch_steps) <= epoch:
            e = len(self._epoch_steps)
            if e in self._plans or not self._plans:
                self._epoch_steps.append(self.plan(e).n_steps)
            else:
                # A later epoch counted ahead (the schedule's total, at start) is not kept:
                # keeping it evicted epoch 0's plan, built again for the first step (a plan
                # costs ~5 s at 10M documents on 2 cores).
                self._epoch_steps.append(self._build(e).n_steps)
        return self._epoch_steps[epoch]

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps of the first epoch."""
        return self.steps_in_epoch(0)

    @property
    def total_steps(self) -> int:
        """Optimizer steps of the run: max_steps, else `epochs` (default 1; a fraction rounds up)."""
        if self.max_steps is not None:
            return self.max_steps
        epochs = 1.0 if self.epochs is None else self.epochs
        whole = math.floor(epochs)
        total = sum(self.steps_in_epoch(e) for e in range(whole))
        if epochs > whole:
            total += math.ceil((epochs - whole) * self.steps_in_epoch(whole))
        return total

    def locate(self, global_step: int) -> tuple[int, int]:
        """(epoch, step within the epoch) of a global step index."""
        epoch = 0
        while global_step >= self.steps_in_epoch(epoch):
            global_step -= self.steps_in_epoch(epoch)
            epoch += 1
        return epoch, global_step

    def micro_batches(self, global_step: int) -> list[MicroBatchSpec]:
        """This rank's micro-batch specs of a step (no data read)."""
        epoch, s = self.locate(global_step)
        return step_micro_batches(
            self.plan(epoch), s, self.settings, self.rank, lockstep=self.lockstep
        )

    def efficiency(self, epoch: int = 0) -> Efficiency:
        """Packing efficiency and padding waste of an epoch, over all ranks, without running a model."""
        return plan_efficiency(
            self.plan(epoch), self.settings, lockstep=self.lockstep, lengths=self.lengths
        )

    def _keys(self, start: int) -> Iterator[_Key]:
        total = self.total_steps
        g = start
        while g < total:
            epoch, s = self.locate(g)
            plan = self.plan(epoch)
            if epoch not in self._step_targets:
                trained = plan.step_trained  # a rank's share counted every rank's
                self._step_targets[epoch] = (
                    plan.per_step_sums(self.targets) if trained is None else trained
                )
            step_targets = int(self._step_targets[epoch][s])
            specs = step_micro_batches(plan, s, self.settings, self.rank, lockstep=self.lockstep)
            for i, spec in enumerate(specs):
                yield _Key(epoch, g, s, i, len(specs), step_targets, spec)
            g += 1

    # --- iteration ----------------------------------------------------------------
    def _make_dataloader(self) -> DataLoader:
        workers = self.num_workers
        return DataLoader(
            self._dataset,
            batch_size=None,
            sampler=_KeySampler(self),
            collate_fn=_identity,
            num_workers=workers,
            pin_memory=self.pin_memory,
            prefetch_factor=self.prefetch_factor if workers > 0 else None,
            persistent_workers=workers > 0,
        )

    def __iter__(self) -> Iterator[MicroBatch]:
        """Micro-batches from the current position to the end of the run."""
        self.store.verified()  # a background checksum check ends before the first batch
        if self._dataloader is None:
            self._dataloader = self._make_dataloader()
        it = iter(self._dataloader)
        while True:
            try:
                batch = next(it)
            except StopIteration:
                return
            except PitstopError:
                raise
            except Exception as e:
                if self.num_workers == 0:
                    raise
                # Shut the broken workers down here rather than in a later garbage collection,
                # and start fresh ones if the caller iterates again.
                shutdown = getattr(it, "_shutdown_workers", None)
                if shutdown is not None:
                    shutdown()
                self._dataloader = None
                raise LoaderError(
                    f"a DataLoader worker failed while reading batches from {self.store.path}: "
                    f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}. "
                    "Rerun with --loader-workers 0 to see the error in the main process; if a "
                    "worker was killed (out of memory), lower --loader-workers or --prefetch-factor"
                ) from e
            m = batch["meta"]
            self._next_step = m.step + (1 if m.last_of_step else 0)
            yield batch

    def resplit(self, settings: BatchSettings) -> None:
        """Split steps into other micro-batches from the step in progress on (the trainer's
        backoff after an out-of-memory). Only the micro-batch setting may differ, so every
        step keeps its documents; the next iteration restarts the step in progress from its
        first micro-batch (what `state_dict()` says after a partial step)."""
        s = self.settings
        same = ("strategy", "max_seq_len", "tokens_per_step", "world_size")
        if any(getattr(settings, k) != getattr(s, k) for k in same):
            raise ValueError(f"resplit may change only the micro-batch split, not {same}")
        old = getattr(self._dataloader, "_iterator", None)  # persistent workers: stop them now
        shutdown = getattr(old, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        self._dataloader = None
        self.settings = settings

    # --- resume -------------------------------------------------------------------
    def state_dict(self) -> LoaderState:
        """Where the run stands: the next step to hand out (as global and as epoch, step)."""
        epoch, step = self.locate(self._next_step)
        s = self.settings
        return {
            "global_step": self._next_step,
            "epoch": epoch,
            "step": step,
            "seed": self.seed,
            "strategy": s.strategy.value,  # the name: a checkpoint holds plain JSON values
            "max_seq_len": s.max_seq_len,
            "tokens_per_step": s.tokens_per_step,
            # Steps of the epochs before this one, so a resume need not plan them again to
            # find its place (each plan is a pass over every document).
            "epoch_steps": [self.steps_in_epoch(e) for e in range(epoch)],
            **self._data_identity(),
            "fill_chunk": plan_module.FILL_CHUNK,
        }

    def _data_identity(self) -> dict[str, int]:
        """Which sequences the plans cover (a changed held-out split changes every step)."""
        used = self.lengths if self.indices is None else self.lengths[self.indices]
        return {"n_sequences": len(used), "n_tokens": int(used.sum())}

    def load_state_dict(self, state: LoaderState) -> None:
        """Continue from a `state_dict()`; refuses if the plan-defining inputs changed.

        The strategy is not one of them: it only lays each step's documents out in rows
        (pitstop.batching.plan), so a run may resume under another layout."""
        s = self.settings
        now = {
            "seed": self.seed,
            "max_seq_len": s.max_seq_len,
            "tokens_per_step": s.tokens_per_step,
            **self._data_identity(),
        }
        changed = [
            f"{k}: {state[k]!r} then, {v!r} now"
            for k, v in now.items()
            if k in state and state[k] != v
        ]
        # The rows differ only where one of the two fills cut the epoch into chunks; a
        # checkpoint from before chunks filled the whole epoch as one.
        then = state.get("fill_chunk")
        if then != plan_module.FILL_CHUNK and now["n_sequences"] > min(
            then or math.inf, plan_module.FILL_CHUNK
        ):
            was = f"in chunks of {then:,} sequences" if then else "over the whole epoch"
            changed.append(
                f"the plan's row fill: {was} then, in chunks of {plan_module.FILL_CHUNK:,} "
                "sequences now (pitstop changed how it plans more sequences than that; finish "
                "this run with the pitstop that started it)"
            )
        if changed:
            raise LoaderError(
                changed,
                header="cannot resume: these change which documents form each step, so the "
                "resumed run would not continue the same data order (restore them, or start a "
                "new run):",
            )
        epoch, step = int(state["epoch"]), int(state["step"])
        known = state.get("epoch_steps")
        if (
            not self._epoch_steps
            and isinstance(known, list)
            and len(known) == epoch
            and all(isinstance(k, int) and not isinstance(k, bool) and k > 0 for k in known)
        ):
            # The same plan inputs (checked above) give the same steps per epoch: taken from
            # the state, a resume in epoch e plans epoch e only, as a start plans epoch 0.
            self._epoch_steps = list(known)
        self._next_step = sum(self.steps_in_epoch(e) for e in range(epoch)) + step
