"""What `pitstop tune` may change, and how a choice becomes a RunConfig.

Every knob here changes only how fast a step runs, never what a step learns:
the tokens per optimizer step are resolved once from the user's config and written
explicitly into every trial's config, and the micro-batch is given as
`tokens_per_micro_batch` (padded positions per forward/backward). pitstop's step
plan depends on (trained tokens per sequence, seed, epoch, tokens_per_step) only
(see pitstop/batching/plan.py), so a different micro-batch size just cuts the same
steps into different pieces, and gradient accumulation follows from it
(micro-batches per step ≈ tokens_per_step / tokens_per_micro_batch).

The batching layout (pack or bucket) is a knob too: a layout only arranges the same
step plan's documents into rows, so every trial trains the same documents in each
step, and no layout lets one document attend to another; they differ in how much
padding is computed. Gradient checkpointing is tried only when nothing fits without it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

from pitstop import probe
from pitstop.batching.settings import BatchSettings, value_rows
from pitstop.catalog.layouts import ANY_STEP_SIZE, worth_timing
from pitstop.core.config import RunConfig

# Knob names as the CLI's --knobs takes them.
KNOBS = ("micro_batch", "batching", "compile", "attention", "workers", "prefetch")


@dataclass(frozen=True)
class Settings:
    """One point of the search: the speed knobs of a run (everything else is the user's)."""

    batching: str  # pack | bucket | pad
    micro_rows: int  # micro-batch = micro_rows x max_seq_len padded positions
    loader_workers: int
    prefetch_factor: int
    compile: bool
    attention: str  # sdpa | eager | flash_attention_2 | flex_attention
    gradient_checkpointing: bool = False

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Settings:
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})

    def label(self) -> str:
        """Short text for tables and logs."""
        parts = [
            self.batching,
            f"mb={self.micro_rows}",
            f"workers={self.loader_workers}",
        ]
        if self.loader_workers:
            parts.append(f"prefetch={self.prefetch_factor}")
        parts += [f"compile={'on' if self.compile else 'off'}", self.attention]
        if self.gradient_checkpointing:
            parts.append("grad-ckpt")
        return " ".join(parts)


@dataclass(frozen=True)
class Space:
    """The values each knob may take for one run (the baseline's value is always allowed)."""

    max_seq_len: int
    tokens_per_step: int
    max_micro_rows: int
    batching: tuple[str, ...] = tuple(m.value for m in worth_timing(True))
    loader_workers: tuple[int, ...] = (0, 1, 2)
    prefetch_factor: tuple[int, ...] = (2, 4)
    compile: tuple[bool, ...] = (False, True)
    attention: tuple[str, ...] = ("sdpa", "eager")
    gradient_checkpointing: bool = True  # may be turned on when nothing fits without it
    tune_micro_batch: bool = True

    def micro_ladder(self) -> list[int]:
        """Micro-batch sizes in rows to probe: powers of two up to a whole step, and a whole step."""
        out, m = [], 1
        while m < self.max_micro_rows:
            out.append(m)
            m *= 2
        out.append(self.max_micro_rows)
        return out

    def micro_batches_per_step(self, s: Settings) -> int:
        """Gradient accumulation a setting implies (exact for pack, about for bucket)."""
        return math.ceil(self.max_micro_rows / max(1, s.micro_rows))

    def coordinates(self) -> list[tuple[str, tuple[Any, ...]]]:
        """(Settings field, values) in the order coordinate descent visits them."""
        return [
            ("batching", self.batching),
            ("compile", self.compile),
            ("attention", self.attention),
            ("loader_workers", self.loader_workers),
            ("prefetch_factor", self.prefetch_factor),
        ]


def resolved_tokens_per_step(cfg: RunConfig) -> int:
    """The tokens per optimizer step the user's config means (explicit, or derived as pitstop does)."""

    # The layout does not enter the tokens-per-step rule; one without a whole-rows rule
    # avoids pack's divisibility check.
    bs = BatchSettings.from_config(cfg, world_size=cfg.nproc, strategy=ANY_STEP_SIZE)
    return bs.tokens_per_step


def apply_settings(cfg: RunConfig, s: Settings, tokens_per_step: int) -> RunConfig:
    """`cfg` with the knobs of `s`, tokens per step pinned to `tokens_per_step`."""
    return dataclasses.replace(
        cfg,
        batching=s.batching,
        tokens_per_step=tokens_per_step,
        grad_accum=None,  # follows from tokens_per_step / tokens_per_micro_batch
        micro_batch_size=None,
        tokens_per_micro_batch=s.micro_rows * cfg.max_seq_len,
        loader_workers=s.loader_workers,
        prefetch_factor=s.prefetch_factor,
        compile="on" if s.compile else "off",
        attention=s.attention,
        gradient_checkpointing=s.gradient_checkpointing,
    )


def settings_from_choices(cfg: RunConfig, choices: dict[str, Any]) -> Settings:
    """The Settings a finished run actually used (its summary's `choices`), for the baseline."""

    def val(name: str, default: Any) -> Any:
        c = choices.get(name)
        return c.get("value", default) if isinstance(c, dict) else default

    msl = cfg.max_seq_len
    # The split the run decided (sized to a GPU, or a CPU's larger default for short rows:
    # batching/resolve.py) is its "micro_batch" choice, "N rows"; "default" or absent: the
    # config's own.
    decided = value_rows(val("micro_batch", None))
    if cfg.tokens_per_micro_batch is not None:
        rows = max(1, cfg.tokens_per_micro_batch // msl)
    elif cfg.micro_batch_size is not None:
        rows = cfg.micro_batch_size
    elif decided is not None:
        rows = decided
    else:
        rows = BatchSettings.from_config(
            cfg, world_size=cfg.nproc, strategy=ANY_STEP_SIZE
        ).micro_rows
    return Settings(
        batching=str(val("batching", cfg.batching)),
        micro_rows=int(rows),
        loader_workers=int(val("loader_workers", cfg.loader_workers or 0)),
        prefetch_factor=int(cfg.prefetch_factor),
        compile=bool(val("compile", cfg.compile == "on")),
        attention=str(val("attention", cfg.attention)),
        gradient_checkpointing=bool(cfg.gradient_checkpointing),
    )


def build_space(
    cfg: RunConfig,
    dev: Any,
    tokens_per_step: int,
    *,
    knobs: tuple[str, ...] = KNOBS,
    baseline: Settings | None = None,
) -> Space:
    """The values worth trying on this machine for this config; knobs not in `knobs` stay put."""

    msl = cfg.max_seq_len
    max_rows = max(1, math.ceil(tokens_per_step / msl / max(1, cfg.nproc)))
    base = baseline
    # pack needs whole rows per step; bucket always works (it cuts steps by real tokens);
    # pad is never faster than bucket (catalog.layouts: dominated_by)
    whole_rows = tokens_per_step % msl == 0
    batching: tuple[str, ...] = tuple(m.value for m in worth_timing(whole_rows))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    # More loader workers than cores only adds contention with the training process.
    workers = tuple(sorted({0, 1, min(2, cpus), min(4, cpus)}))
    ok_compile, _ = probe.compile_status()
    compile_ = (False, True) if ok_compile else (False,)
    attention = ["sdpa", "eager"]
    flash_ok, _ = probe.flash_attn_status(dev, probe.choose_precision(cfg.precision, dev).value)
    if flash_ok:
        attention.insert(0, "flash_attention_2")
    else:  # pitstop's per-document SDPA: what `auto` trains with where flash-attn cannot run
        attention.insert(0, "sdpa_docs")
    if not flash_ok and probe.flex_attention_status(dev)[0]:
        # A GPU without flash-attn: flex's block mask against sdpa's dense one, measured here.
        attention.insert(1, "flex_attention")

    def keep(name: str, values: tuple[Any, ...], current: Any) -> tuple[Any, ...]:
        return values if name in knobs else (current,)

    return Space(
        max_seq_len=msl,
        tokens_per_step=tokens_per_step,
        max_micro_rows=max_rows,
        batching=keep("batching", batching, base.batching if base else batching[0]),
        loader_workers=keep("workers", workers, base.loader_workers if base else 0),
        prefetch_factor=keep("prefetch", (2, 4), base.prefetch_factor if base else 2),
        compile=keep("compile", compile_, base.compile if base else False),
        attention=keep("attention", tuple(attention), base.attention if base else attention[0]),
        tune_micro_batch="micro_batch" in knobs,
    )
