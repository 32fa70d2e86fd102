"""The batch shape of a training run, decided once: strategy, tokens per step, micro-batch.

`resolve_batch_shape` is the one place that decides it, from a `BatchRequest` (the
config, the token store, the world size, the device's `MicroSizer` on a GPU, the run
directory); it returns the `BatchSettings` the loader runs with, the choices the banner shows (with
their reasons) and the measurements `--resume` and reruns reuse. `halve` is the other
decision of the micro-batch size: the back-off after a CUDA out-of-memory
(train/oom.py). No other module decides a micro-batch size
(tests/test_batching_resolve.py scans the package).

Order: the micro-batch is sized to the device first (a GPU run that did not set it;
measured once and reused), so that `batching: auto` times each layout at that size;
then `auto` resolves from the run directory on --resume (never re-measured; an older
run without a record keeps its checkpoint's strategy), else the measured-choices
cache, else by timing (pitstop.batching.choices). The config is never rewritten: a
sized micro-batch is a field of the returned settings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pitstop.batching.choices import NOT_MEASURED, MeasureResult
from pitstop.batching.loader import LoaderOptions, MicroBatchLoader
from pitstop.batching.microsize import largest_predicted, modelled_rows, sizing_payoff
from pitstop.batching.records import MicroBatch
from pitstop.batching.settings import DEFAULT_MICRO_ROWS, BatchSettings, rows_value
from pitstop.catalog.layouts import ANY_STEP_SIZE, Layout
from pitstop.core import log
from pitstop.core.cache_layout import cache_root
from pitstop.core.config import RunConfig
from pitstop.core.errors import PitstopError
from pitstop.core.run_record import ChoiceRecord
from pitstop.data.store import TokenStore
from pitstop.probe import Choice


@dataclass
class BatchShape:
    """What `resolve_batch_shape` decided."""

    settings: BatchSettings
    choices: dict[str, Choice] = field(default_factory=dict)  # batching, micro_batch
    # What was measured (pitstop.batching.choices.MeasuredChoices); None: nothing was.
    measured: ChoiceRecord | None = None


@dataclass
class MicroSizer:
    """What sizing the micro-batch to the device needs (pitstop.batching.microsize).

    `measure(batch)`: (peak bytes, seconds) of a forward+backward of a micro-batch dict
    (math.inf for both when it ran out of memory);
    `capacity_bytes`: device memory this run can use; `reserved_bytes`: what the first
    optimizer step still allocates (not in a measured peak); `predict(rows)`: the memory
    cost model's peak, unmeasured;
    `start_peak_window()`: called once the batch shape is decided, after the last trial
    pass (the sizer's and `batching: auto`'s), so that the run's peak memory
    (pitstop.measure.memory) is its steps' and not its largest trial's.
    """

    measure: Callable[[MicroBatch], tuple[float, float]]
    capacity_bytes: float
    reserved_bytes: float
    start_peak_window: Callable[[], None] | None = None
    # rows -> predicted peak bytes (the memory cost model): the pick where measuring would
    # not pay back on the run (pitstop.batching.payoff); None: the default split there.
    predict: Callable[[int], float] | None = None


@dataclass(frozen=True)
class BatchRequest:
    """Everything deciding a run's batch shape reads: `resolve_batch_shape` and
    `train.data.build_loader` take one of these.

    `run_micro_batch(batch)`: one timed forward+backward (`batching: auto`);
    `resume_strategy`: the newest checkpoint's layout (an `auto` run from before run
    records keeps it); `indices`: the store's sequence ids to train on (None: all);
    `lockstep`: equal micro-batch counts on every rank (FSDP); `sizer`: size the
    micro-batch to the device; `out`: the run directory (its recorded choices on resume);
    `seconds_per_position`: a position's estimated forward+backward here, which weighs
    each first-run measurement against the planned run (pitstop.batching.payoff; None:
    measure as asked).
    """

    cfg: RunConfig
    store: TokenStore
    rank: int = 0
    world_size: int = 1
    run_micro_batch: Callable[[MicroBatch], object] | None = None
    resume_strategy: str | None = None
    indices: np.ndarray | None = None
    lockstep: bool = False
    device_name: str = "unknown"
    device_type: str = "unknown"
    out: Path | None = None
    cache_dir: str | None = None
    sizer: MicroSizer | None = None
    seconds_per_position: float | None = None


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


# A CPU micro-batch of up to this many positions (whole rows, dividing the step): on a
# 2-core AMD EPYC, rows of 256, `python -m bench.tune` at 5909263 (bench/results/tune.md
# there) measured 10,579 trained tok/s at 2 rows (512 positions), 11,776 at 4 and 12,209
# at 8 (sdpa_docs, eager). Rows of 1024 keep the default 2 (the same 2,048 positions).
CPU_MICRO_POSITIONS = 2048


def cpu_micro_rows(max_rows: int, max_seq_len: int) -> int | None:
    """Rows per CPU micro-batch when more than the default: the largest divisor of a step's
    rows per rank within CPU_MICRO_POSITIONS (a step splits into equal micro-batches)."""
    target = max(1, CPU_MICRO_POSITIONS // max_seq_len)
    rows = max(d for d in range(1, min(target, max_rows) + 1) if max_rows % d == 0)
    return rows if rows > DEFAULT_MICRO_ROWS else None


def max_rows_per_rank(cfg: RunConfig, world_size: int) -> int:
    """Full rows of max_seq_len in one rank's share of an optimizer step."""
    # A layout without a whole-rows rule on tokens_per_step, so any step size is accepted.
    s = BatchSettings.from_config(cfg, world_size=world_size, strategy=ANY_STEP_SIZE)
    return max(1, s.tokens_per_step // s.max_seq_len // world_size)


def resolve_batch_shape(req: BatchRequest) -> BatchShape:
    """The run's batch shape (see the module docstring and `BatchRequest`)."""
    cfg, sizer, world_size = req.cfg, req.sizer, req.world_size
    choices: dict[str, Choice] = {}
    micro_mc = None
    rows: int | None = None
    not_sized = micro_sizing_applies(cfg, world_size) if sizer is not None else "no sizer"
    if sizer is not None and not_sized is None:
        try:
            rows, micro_mc, why = _sized_micro_batch(req, sizer)
        except PitstopError:
            raise
        except Exception as e:
            # Sizing is an optimisation: its failure must not stop a run the default split
            # trains. One process only: with several, the ranks' sizing is collective and
            # a rank that gave up alone would leave the others waiting.
            if world_size > 1:
                raise
            rows, micro_mc = None, None
            why = f"sizing to the device failed ({type(e).__name__}: {e}); the default split"
            log.warning(f"pitstop: warning: {why}")
        choices["micro_batch"] = Choice(rows_value(rows) if rows else "default", why)
    elif sizer is not None and not_sized != "set":
        choices["micro_batch"] = Choice("default", f"not sized to the device: {not_sized}")
    elif req.device_type == "cpu" and micro_sizing_applies(cfg, world_size) is None:
        rows = cpu_micro_rows(max_rows_per_rank(cfg, world_size), cfg.max_seq_len)
        if rows is not None:
            choices["micro_batch"] = Choice(
                rows_value(rows),
                f"CPU: {rows} rows of {cfg.max_seq_len} ({rows * cfg.max_seq_len:,} positions) a "
                f"micro-batch, not {DEFAULT_MICRO_ROWS}: short rows run small, slow kernels",
            )
    # What `auto`'s timing and its cache key read: the config with the sized split (a
    # view local to this function; the run's config is not changed).
    seen = (
        cfg
        if rows is None
        else dataclasses.replace(cfg, tokens_per_micro_batch=rows * cfg.max_seq_len)
    )
    strategy: str | None = None
    reason = None
    measured = None
    if cfg.batching == "auto":
        from pitstop.batching.choices import read_run_choices

        kept = read_run_choices(req.out) if cfg.resume and req.out is not None else None
        if kept is None and req.resume_strategy is not None:
            strategy = req.resume_strategy
            reason = "kept from the checkpoint: a resumed run keeps its data order"
        else:
            measured = _measured_batching(dataclasses.replace(req, cfg=seen))
            strategy = measured.values["batching"]
            reason = measured.describe("batching")
    settings = BatchSettings.from_config(seen, world_size=world_size, strategy=strategy)
    layout = settings.strategy.value  # the name, as the banner and summary.json print it
    choices = {"batching": Choice(layout, reason or settings.reason or "set"), **choices}
    if micro_mc is not None:
        measured = measured.merged(micro_mc, "micro_batch") if measured else micro_mc
    if sizer is not None and sizer.start_peak_window is not None:
        # The trials above ran forward+backward passes as large as the device holds (one
        # may even have run out of memory): none of them is a training step.
        sizer.start_peak_window()
    return BatchShape(settings, choices, measured)


def halve(settings: BatchSettings) -> tuple[BatchSettings, str] | None:
    """`settings` with micro-batches half as large (whole rows), and how many rows that
    is; None at one row already. The back-off after a CUDA out-of-memory: the steps,
    and so the training math, stay the same."""
    msl = settings.max_seq_len
    if settings.micro_batch_size is not None:
        if settings.micro_batch_size <= 1:
            return None
        rows = settings.micro_batch_size // 2
        return dataclasses.replace(settings, micro_batch_size=rows), rows_value(rows)
    budget = settings.tokens_per_micro_batch or msl
    if budget // 2 < msl:
        return None
    half = budget // 2 // msl * msl  # whole rows of max_seq_len
    return dataclasses.replace(settings, tokens_per_micro_batch=half), rows_value(half // msl)


def loader_options(cfg: RunConfig) -> LoaderOptions:
    """The loader's own settings, from the run's config."""
    return LoaderOptions(
        seed=cfg.seed,
        epochs=cfg.epochs,
        max_steps=cfg.max_steps,
        workers=cfg.loader_workers,
        pin_memory=cfg.pin_memory != "off",
        prefetch_factor=cfg.prefetch_factor,
    )


def loader_for(
    store: TokenStore,
    cfg: RunConfig,
    *,
    rank: int = 0,
    world_size: int = 1,
    strategy: Layout | str | None = None,
    indices: np.ndarray | None = None,
    lockstep: bool = False,
) -> MicroBatchLoader:
    """A loader of `cfg` as set (nothing measured; `batching` must not be `auto` unless
    `strategy` is given): for tests, benchmarks and callers with a config in hand."""
    settings = BatchSettings.from_config(cfg, world_size=world_size, strategy=strategy)
    return MicroBatchLoader(
        store, settings, loader_options(cfg), rank=rank, indices=indices, lockstep=lockstep
    )


MICRO_ROWS = "micro_batch_rows"  # its name among the measured choices


def _sized_micro_batch(
    req: BatchRequest, sizer: MicroSizer
) -> tuple[int | None, ChoiceRecord | None, str]:
    """(rows per micro-batch or None for the default, its MeasuredChoices, the banner reason).

    A resumed run keeps what its run directory recorded (a run that started with the
    default keeps the default), else the cache, else measured (rank 0's wins). On resume
    no record is returned: the run directory's `choices.json` already holds it."""
    from pitstop.batching.auto import rank0_choice
    from pitstop.batching.choices import read_run_choices, resolve_measured
    from pitstop.batching.loader import sequence_targets
    from pitstop.batching.microsize import choose_micro_rows, packed_sample

    cfg, store, indices = req.cfg, req.store, req.indices
    if cfg.resume and req.out is not None:
        kept = read_run_choices(req.out)
        rows = kept.values.get(MICRO_ROWS) if kept is not None else None
        if rows is None:
            return None, None, "kept from this run: it started with the default split"
        return int(rows), None, kept.describe(MICRO_ROWS)
    key, fields = _choice_key(req, what="micro_batch")
    max_rows = max_rows_per_rank(cfg, req.world_size)
    trained = sequence_targets(store)

    def measure() -> MeasureResult:
        unpaid = _unmeasured_micro_rows(req, sizer, max_rows)
        if unpaid is not None:
            return unpaid
        if req.rank == 0:
            log.info("pitstop: sizing the micro-batch to the device ...")
        step_tokens = max_rows * cfg.max_seq_len

        def run(rows: int) -> tuple[float, float]:
            batch = packed_sample(
                store,
                rows=rows,
                max_seq_len=cfg.max_seq_len,
                tokens_per_step=step_tokens,
                seed=cfg.seed,
                trained=trained,
                indices=indices,
            )
            return sizer.measure(batch)

        pick = choose_micro_rows(
            run,
            max_rows=max_rows,
            row_tokens=cfg.max_seq_len,
            capacity_bytes=sizer.capacity_bytes,
            reserved_bytes=sizer.reserved_bytes,
        )
        return {MICRO_ROWS: pick.rows}, {MICRO_ROWS: pick.reason}, pick.measurements()

    mc = resolve_measured(
        key=key,
        key_fields=fields,
        cache_dir=cache_root(req.cache_dir),
        measure=measure,
        run_dir=None,
        resume=False,
        remeasure=cfg.remeasure,
        store_result=req.rank == 0,
    )
    mc = rank0_choice(mc, req.world_size)
    rows = mc.values[MICRO_ROWS]
    return (int(rows) if rows else None), mc, mc.describe(MICRO_ROWS)


def _unmeasured_micro_rows(
    req: BatchRequest, sizer: MicroSizer, max_rows: int
) -> MeasureResult | None:
    """The micro-batch from the memory cost model, when measuring it would not pay back on
    this run (pitstop.batching.payoff), as a measurement's (values, reasons, facts); None:
    measure. One process only: with several a rank's out-of-memory has no back-off."""
    pays = sizing_payoff(
        max_rows=max_rows,
        row_tokens=req.cfg.max_seq_len,
        run_positions=planned_positions(req) / max(1, req.world_size),
        seconds_per_position=req.seconds_per_position,
        predicted_rows=largest_predicted(sizer.predict, max_rows, sizer.capacity_bytes),
    )
    if pays is None or pays.worth or req.world_size > 1:
        return None
    rows, why = modelled_rows(sizer.predict, max_rows=max_rows, capacity_bytes=sizer.capacity_bytes)
    why = f"not measured: {pays.describe('sizing it')}; {why}"
    return {MICRO_ROWS: rows}, {MICRO_ROWS: why}, {NOT_MEASURED: pays.to_dict()}


def planned_positions(req: BatchRequest) -> float:
    """The run's planned positions, every rank's, before any plan is built: max_steps full
    steps, else its epochs of the training documents' tokens (packing fills rows nearly)."""
    cfg = req.cfg
    if cfg.max_steps:
        s = BatchSettings.from_config(cfg, world_size=req.world_size, strategy=ANY_STEP_SIZE)
        return float(cfg.max_steps * s.tokens_per_step)
    lengths = np.asarray(req.store.lengths)
    tokens = lengths[req.indices].sum() if req.indices is not None else lengths.sum()
    return float(tokens) * float(cfg.epochs or 1.0)


def _measured_batching(req: BatchRequest) -> ChoiceRecord:
    """`auto`'s layout: the run's record on resume, else the cache, else measured (rank 0's wins)."""
    from dataclasses import asdict

    from pitstop.batching.auto import choose_batching, rank0_choice
    from pitstop.batching.choices import resolve_measured

    cfg = req.cfg
    key, fields = _choice_key(req)

    def say(line: str) -> None:
        if req.rank == 0:
            log.info(f"pitstop: {line}")

    def measure() -> MeasureResult:
        if req.run_micro_batch is None:
            raise ValueError("batching auto needs run_micro_batch")  # a bug, not user error
        auto = choose_batching(
            req.store,
            cfg,
            req.run_micro_batch,
            rank=req.rank,
            world_size=req.world_size,
            indices=req.indices,
            lockstep=req.lockstep,
            broadcast=False,
            progress=say,
            seconds_per_position=req.seconds_per_position,
        )
        found = {
            "timings": {k: asdict(t) for k, t in auto.timings.items()},
            "skipped": auto.skipped,
            "noise": auto.noise,
            "rounds": auto.rounds,
        }
        if auto.unpaid is not None:
            found[NOT_MEASURED] = auto.unpaid.to_dict()
        # The layout's name, not the member: the record is JSON and read back as text.
        return {"batching": str(auto.strategy)}, {"batching": auto.reason}, found

    # Only rank 0 writes the cache; every rank then adopts rank 0's resolution (a rank
    # may find the cache entry another has not, or time differently).
    mc = resolve_measured(
        key=key,
        key_fields=fields,
        cache_dir=cache_root(req.cache_dir),
        measure=measure,
        run_dir=req.out,
        resume=cfg.resume,
        remeasure=cfg.remeasure,
        store_result=req.rank == 0,
    )
    return rank0_choice(mc, req.world_size)


def _choice_key(req: BatchRequest, what: str | None = None) -> tuple[str, dict[str, Any]]:
    """The measured-choices key of `req` (what a cached `what` depends on)."""
    from pitstop.batching.choices import choice_key

    return choice_key(
        req.cfg,
        device_name=req.device_name,
        device_count=req.world_size,
        store_manifest=Path(req.store.path) / "manifest.json",
        indices_count=None if req.indices is None else len(req.indices),
        what=what,
    )
