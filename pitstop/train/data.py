"""Where the trainer's batches come from: the token store and pitstop.batching's loader.

The loader contract (pitstop.batching.MicroBatchLoader): iterating yields micro-batch
dicts {input_ids Long[B,T], labels Long[B,T] (-100 = not a target; the model shifts),
position_ids Long[B,T] (restarting at 0 per packed document), cu_seqlens Int32[n+1],
max_seqlen int, meta `pitstop.batching.records.MicroBatchMeta`} up to the end of the run, with `state_dict()` /
`load_state_dict()` for exact resume and `steps_per_epoch` / `total_steps` known up
front. The trainer accepts any object honouring it (tests pass small ones).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pitstop import log, run_record
from pitstop.batching.settings import DEFAULT_MICRO_ROWS, BatchSettings
from pitstop.cache_layout import cache_root
from pitstop.config import RunConfig
from pitstop.probe import Choice


@dataclass
class Geometry:
    """The shape of the training math, for the banner and FLOPs/compile estimates."""

    strategy: str
    max_seq_len: int
    tokens_per_step: int
    micro: str  # how a step is split into micro-batches, in words
    choices: dict[str, Choice] = field(default_factory=dict)
    efficiency: dict[str, float] = field(default_factory=dict)
    measured: Any = None  # pitstop.batching.choices.MeasuredChoices of `auto`, else None


@dataclass
class MicroSizer:
    """What sizing the micro-batch to the device needs (pitstop.batching.microsize).

    `measure(batch)`: (peak bytes, seconds) of a forward+backward of a micro-batch dict
    (math.inf for both when it ran out of memory);
    `capacity_bytes`: device memory this run can use; `reserved_bytes`: what the first
    optimizer step still allocates (not in a measured peak).
    """

    measure: Callable[[dict[str, Any]], tuple[float, float]]
    capacity_bytes: float
    reserved_bytes: float


def micro_sizing_applies(cfg: RunConfig, world_size: int) -> str | None:
    """Why the micro-batch is not sized to the device (None: it is)."""
    if cfg.micro_batch_size is not None or cfg.tokens_per_micro_batch is not None:
        return "set"
    if cfg.grad_accum is not None:
        return "--grad-accum given: micro_batch_size 1 unless set"
    rows = max_rows_per_rank(cfg, world_size)
    if rows <= DEFAULT_MICRO_ROWS:
        return f"a step holds {rows} full row(s) per rank: nothing larger to try"
    return None


def max_rows_per_rank(cfg: RunConfig, world_size: int) -> int:
    """Full rows of max_seq_len in one rank's share of an optimizer step."""
    # "pad": the one layout without a multiple-of-max_seq_len rule on tokens_per_step
    s = BatchSettings.from_config(cfg, world_size=world_size, strategy="pad")
    return max(1, s.tokens_per_step // s.max_seq_len // world_size)


def open_training_store(cfg: RunConfig) -> Any:
    from pitstop.data.prepare import open_store
    from pitstop.data.store import check_vocab

    store = open_store(cfg)
    check_vocab(store, cfg.model)  # an id past the embedding fails mid-step otherwise
    return store


def saved_strategy(out: Path) -> str | None:
    """The batching strategy of the newest checkpoint in `out` (a resumed `auto` run keeps it)."""
    import json

    from pitstop.train.checkpoint import latest_checkpoint

    ck = latest_checkpoint(out / run_record.CHECKPOINTS)
    if ck is None or not (ck / "loader_state.json").is_file():
        return None
    return json.loads((ck / "loader_state.json").read_text(encoding="utf-8")).get("strategy")


def build_loader(
    cfg: RunConfig,
    *,
    store: Any,
    rank: int,
    world_size: int,
    run_micro_batch: Callable[[dict[str, Any]], object] | None,
    resume_strategy: str | None = None,
    indices: Any = None,
    lockstep: bool = False,
    device_name: str = "unknown",
    out: Path | None = None,
    cache_dir: str | None = None,
    sizer: MicroSizer | None = None,
) -> tuple[Any, Geometry]:
    """The run's MicroBatchLoader; `batching: auto` is measured once and reused.

    `auto` resolves from the run directory on `--resume` (never re-measured; an older
    run without a record keeps its checkpoint's strategy, `resume_strategy`), else from
    the measured-choices cache, else by timing (pitstop.batching.choices).
    `indices`: the store's sequence ids to train on (None: all; `--eval-data auto` holds
    some out). `lockstep`: equal micro-batch counts on every rank (FSDP).
    `sizer`: size the micro-batch to the device (a GPU run that did not set it): measured
    once and reused like `auto` (the batching layout is then timed at that size).
    """
    from pitstop.batching.loader import MicroBatchLoader

    micro_choice: Choice | None = None
    micro_mc = None
    not_sized = micro_sizing_applies(cfg, world_size) if sizer is not None else "no sizer"
    if sizer is not None and not_sized is None:
        rows, micro_mc, why = _sized_micro_batch(
            cfg, store=store, rank=rank, world_size=world_size, indices=indices,
            device_name=device_name, out=out, cache_dir=cache_dir, sizer=sizer,
        )  # fmt: skip
        micro_choice = Choice(f"{rows} rows" if rows else "default", why)
        if rows is not None:  # the loader, `auto`'s timing and its cache key see this split
            cfg = dataclasses.replace(cfg, tokens_per_micro_batch=rows * cfg.max_seq_len)
    elif sizer is not None and not_sized != "set":
        micro_choice = Choice("default", f"not sized to the device: {not_sized}")
    strategy = None
    batching_reason = None
    measured = None
    if cfg.batching == "auto":
        from pitstop.batching.choices import read_run_choices

        kept = read_run_choices(out) if cfg.resume and out is not None else None
        if kept is None and resume_strategy is not None:
            strategy = resume_strategy
            batching_reason = "kept from the checkpoint: a resumed run keeps its data order"
        else:
            measured = _measured_batching(
                cfg, store=store, rank=rank, world_size=world_size,
                run_micro_batch=run_micro_batch, indices=indices, lockstep=lockstep,
                device_name=device_name, out=out, cache_dir=cache_dir,
            )  # fmt: skip
            strategy = measured.values["batching"]
            batching_reason = measured.describe("batching")
    loader = MicroBatchLoader(
        store, cfg, rank=rank, world_size=world_size, strategy=strategy,
        indices=indices, lockstep=lockstep,
    )  # fmt: skip
    s = loader.settings
    choices = {
        "batching": Choice(s.strategy, batching_reason or loader.choices["batching"]),
        "loader_workers": Choice(loader.num_workers, loader.choices["loader_workers"]),
        "pin_memory": Choice(loader.pin_memory, loader.choices["pin_memory"]),
    }
    micro = (
        f"{s.micro_batch_size} rows per micro-batch"
        if s.micro_batch_size is not None
        else f"micro-batches of up to {s.tokens_per_micro_batch:,} positions"
    )
    eff = loader.efficiency(0)
    efficiency = {
        "packing_efficiency": float(eff.packing_efficiency),
        "padding_waste": float(eff.padding_waste),
    }
    if micro_choice is not None:
        choices["micro_batch"] = micro_choice
    if micro_mc is not None:
        measured = measured.merged(micro_mc, "micro_batch") if measured else micro_mc
    geo = Geometry(s.strategy, s.max_seq_len, s.tokens_per_step, micro, choices, efficiency)
    geo.measured = measured
    return loader, geo


MICRO_ROWS = "micro_batch_rows"  # its name among the measured choices


def _sized_micro_batch(
    cfg: RunConfig,
    *,
    store: Any,
    rank: int,
    world_size: int,
    indices: Any,
    device_name: str,
    out: Path | None,
    cache_dir: str | None,
    sizer: MicroSizer,
) -> tuple[int | None, Any, str]:
    """(rows per micro-batch or None for the default, its MeasuredChoices, the banner reason).

    A resumed run keeps what its run directory recorded (a run that started with the
    default keeps the default), else the cache, else measured (rank 0's wins). On resume
    no record is returned: the run directory's `choices.json` already holds it."""
    from pitstop.batching.auto import rank0_choice
    from pitstop.batching.choices import choice_key, read_run_choices, resolve_measured
    from pitstop.batching.loader import sequence_targets
    from pitstop.batching.microsize import choose_micro_rows, packed_sample

    if cfg.resume and out is not None:
        kept = read_run_choices(out)
        rows = kept.values.get(MICRO_ROWS) if kept is not None else None
        if rows is None:
            return None, None, "kept from this run: it started with the default split"
        return int(rows), None, kept.describe(MICRO_ROWS)
    key, fields = choice_key(
        cfg, device_name=device_name, device_count=world_size,
        store_manifest=Path(store.path) / "manifest.json",
        indices_count=None if indices is None else len(indices), what="micro_batch",
    )  # fmt: skip
    max_rows = max_rows_per_rank(cfg, world_size)
    trained = sequence_targets(store)

    def measure() -> tuple[dict[str, Any], dict[str, str], dict[str, Any]]:
        if rank == 0:
            log.info("pitstop: sizing the micro-batch to the device ...")

        def run(rows: int) -> tuple[float, float]:
            batch = packed_sample(
                store, rows=rows, max_seq_len=cfg.max_seq_len,
                tokens_per_step=max_rows * cfg.max_seq_len, seed=cfg.seed, trained=trained,
                indices=indices,
            )  # fmt: skip
            return sizer.measure(batch)

        pick = choose_micro_rows(
            run, max_rows=max_rows, row_tokens=cfg.max_seq_len,
            capacity_bytes=sizer.capacity_bytes, reserved_bytes=sizer.reserved_bytes,
        )  # fmt: skip
        return {MICRO_ROWS: pick.rows}, {MICRO_ROWS: pick.reason}, pick.measurements()

    mc = resolve_measured(
        key=key, key_fields=fields, cache_dir=cache_root(cache_dir), measure=measure,
        run_dir=None, resume=False, remeasure=cfg.remeasure, store_result=rank == 0,
    )  # fmt: skip
    mc = rank0_choice(mc, world_size)
    return int(mc.values[MICRO_ROWS]), mc, mc.describe(MICRO_ROWS)


def _measured_batching(
    cfg: RunConfig,
    *,
    store: Any,
    rank: int,
    world_size: int,
    run_micro_batch: Callable[[dict[str, Any]], object] | None,
    indices: Any,
    lockstep: bool,
    device_name: str,
    out: Path | None,
    cache_dir: str | None,
) -> Any:
    """`auto`'s layout: the run's record on resume, else the cache, else measured (rank 0's wins)."""
    from dataclasses import asdict

    from pitstop.batching.auto import choose_batching, rank0_choice
    from pitstop.batching.choices import choice_key, resolve_measured

    key, fields = choice_key(
        cfg, device_name=device_name, device_count=world_size,
        store_manifest=Path(store.path) / "manifest.json",
        indices_count=None if indices is None else len(indices),
    )  # fmt: skip

    def say(line: str) -> None:
        if rank == 0:
            log.info(f"pitstop: {line}")

    def measure() -> tuple[dict[str, Any], dict[str, str], dict[str, Any]]:
        if run_micro_batch is None:
            raise ValueError("batching auto needs run_micro_batch")  # a bug, not user error
        auto = choose_batching(
            store,
            cfg,
            run_micro_batch,
            rank=rank,
            world_size=world_size,
            indices=indices,
            lockstep=lockstep,
            broadcast=False,
            progress=say,
        )
        found = {
            "timings": {k: asdict(t) for k, t in auto.timings.items()},
            "skipped": auto.skipped, "noise": auto.noise, "rounds": auto.rounds,
        }  # fmt: skip
        return {"batching": auto.strategy}, {"batching": auto.reason}, found

    # Only rank 0 writes the cache; every rank then adopts rank 0's resolution (a rank
    # may find the cache entry another has not, or time differently).
    mc = resolve_measured(
        key=key, key_fields=fields, cache_dir=cache_root(cache_dir), measure=measure,
        run_dir=out, resume=cfg.resume, remeasure=cfg.remeasure, store_result=rank == 0,
    )  # fmt: skip
    return rank0_choice(mc, world_size)


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
        import numpy as np

        from pitstop.batching.split import holdout_split

        split = holdout_split(np.asarray(train_store.doc_ids))
        return EvalData(train_store, split.eval, split.train, split.describe())
    from pitstop.data.prepare import open_store

    store = open_store(cfg, data=[cfg.eval_data], progress=False)
    return EvalData(store, None, None, f"{cfg.eval_data} ({len(store.lengths)} sequences)")


def steps_for(cfg_epochs: float | None, max_steps: int | None, steps_per_epoch: int) -> int:
    """Total optimizer steps when a loader does not say: --max-steps, else epochs x steps."""
    if max_steps is not None:
        return max_steps
    return max(1, math.ceil((cfg_epochs or 1.0) * steps_per_epoch))
