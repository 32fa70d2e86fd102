"""How a run is cut into optimizer steps and micro-batches, resolved once from the RunConfig.

The optimizer step is the unit of the training math: `tokens_per_step` fixes which
documents train together. The micro-batch setting (rows, or a padded-token budget)
only says how a step is split for memory, so the tuner can change it without
changing what is learned.
"""

from __future__ import annotations

from dataclasses import dataclass

from pitstop.catalog.layouts import Layout, choices_text
from pitstop.core.config import RunConfig
from pitstop.core.errors import ConfigError

# Default step: 8 full rows (or one per rank when there are more ranks), a common
# small fine-tuning batch; the tuner and the user move it, never silently.
DEFAULT_ROWS_PER_STEP = 8
# Default micro-batch: two full rows of padded tokens, small enough for a 7B model
# at 2k context on a 24 GB card with gradient checkpointing, big enough for a tiny model.
DEFAULT_MICRO_ROWS = 2


def rows_value(rows: int) -> str:
    """The recorded value of a decided micro-batch ("8 rows"): summary.json's
    `choices.micro_batch.value`, which `value_rows` reads back."""
    return f"{rows} rows"


def value_rows(value: object) -> int | None:
    """The rows a recorded `micro_batch` value names ("8 rows" -> 8); None for "default",
    an absent value or anything else."""
    words = str(value).split() if isinstance(value, str) else []
    if len(words) == 2 and words[1] == "rows" and words[0].isdigit() and int(words[0]) > 0:
        return int(words[0])
    return None


@dataclass(frozen=True)
class BatchSettings:
    """Plan-defining numbers (strategy, max_seq_len, tokens_per_step) plus the micro-batch split.

    Exactly one of `micro_batch_size` (rows) and `tokens_per_micro_batch` (padded
    positions = rows x longest row) is set.
    """

    strategy: Layout  # a name given is stored as its member (__post_init__)
    max_seq_len: int
    tokens_per_step: int
    micro_batch_size: int | None = None
    tokens_per_micro_batch: int | None = None
    world_size: int = 1
    reason: str = ""

    def __post_init__(self) -> None:
        # A name ("pack", from a caller or a test) becomes its member, so `strategy`'s
        # properties can be read; an unknown name stays for check_settings to report.
        layout = Layout.lookup(self.strategy)
        if layout is not None:
            object.__setattr__(self, "strategy", layout)
        problems = check_settings(self)
        if problems:
            raise ConfigError(problems, header=f"invalid batching ({len(problems)} problem(s)):")

    @property
    def rows_per_step(self) -> int | None:
        """Rows of a step made of whole rows (pack; bucket/pad rows vary in number)."""
        whole = self.strategy.step_in_whole_rows
        return self.tokens_per_step // self.max_seq_len if whole else None

    @property
    def micro_rows(self) -> int:
        """Rows of a micro-batch: `micro_batch_size`, else its positions over the row length
        (at least one)."""
        if self.micro_batch_size:
            return self.micro_batch_size
        return max(1, (self.tokens_per_micro_batch or self.max_seq_len) // self.max_seq_len)

    @classmethod
    def from_config(
        cls, cfg: RunConfig, *, world_size: int = 1, strategy: Layout | str | None = None
    ) -> BatchSettings:
        """Resolve the config's batching options; `strategy` replaces `cfg.batching` (needed for auto)."""
        strat = strategy or cfg.batching
        if strat == "auto":
            raise ValueError(
                "batching='auto' must be resolved first (pitstop.batching.auto.choose_batching), "
                "then passed as strategy="
            )  # a bug in the caller, not a user error
        msl = cfg.max_seq_len
        why: list[str] = []
        if cfg.tokens_per_step is not None:
            tps = cfg.tokens_per_step
            why.append(f"tokens_per_step {tps} (set)")
        elif cfg.grad_accum is not None or cfg.micro_batch_size is not None:
            rows = (cfg.micro_batch_size or 1) * (cfg.grad_accum or 1)
            tps = rows * msl * world_size
            why.append(
                f"tokens_per_step {tps} = micro_batch_size {cfg.micro_batch_size or 1} x grad_accum "
                f"{cfg.grad_accum or 1} x max_seq_len {msl} x {world_size} rank(s)"
            )
        else:
            tps = max(DEFAULT_ROWS_PER_STEP, world_size) * msl
            why.append(f"tokens_per_step {tps} = {tps // msl} rows of {msl} (default)")
        mbs, tpmb = cfg.micro_batch_size, cfg.tokens_per_micro_batch
        if mbs is None and tpmb is None:
            if cfg.grad_accum is not None:
                mbs = 1
                why.append("micro_batch_size 1 (grad_accum given without it)")
            else:
                per_rank_rows = max(1, tps // msl // world_size)
                tpmb = min(DEFAULT_MICRO_ROWS, per_rank_rows) * msl
                why.append(f"tokens_per_micro_batch {tpmb} (default: {tpmb // msl} full row(s))")
        return cls(strat, msl, tps, mbs, tpmb, world_size, "; ".join(why))


def check_settings(s: BatchSettings) -> list[str]:
    p: list[str] = []
    layout = Layout.lookup(s.strategy)
    if layout is None:
        p.append(f"batching {s.strategy!r} is not one of {choices_text()}")
    if s.max_seq_len < 1:
        p.append(f"max_seq_len must be positive, got {s.max_seq_len}")
    if s.world_size < 1:
        p.append(f"world size must be at least 1, got {s.world_size}")
    if s.tokens_per_step < s.max_seq_len:
        p.append(
            f"tokens_per_step {s.tokens_per_step} is below max_seq_len {s.max_seq_len}: "
            "one full row must fit in an optimizer step"
        )
    whole_rows = layout is not None and layout.step_in_whole_rows
    if whole_rows and s.tokens_per_step % s.max_seq_len:
        p.append(
            f"tokens_per_step {s.tokens_per_step} is not a whole number of packed rows of "
            f"{s.max_seq_len} tokens; use a multiple of max_seq_len"
        )
    elif whole_rows and s.tokens_per_step // s.max_seq_len < s.world_size:
        p.append(
            f"tokens_per_step {s.tokens_per_step} makes {s.tokens_per_step // s.max_seq_len} packed "
            f"row(s) per step for {s.world_size} ranks: every step would leave a rank idle; use at "
            f"least {s.world_size * s.max_seq_len}"
        )
    if (s.micro_batch_size is None) == (s.tokens_per_micro_batch is None):
        p.append("give exactly one of micro_batch_size and tokens_per_micro_batch")
    if s.micro_batch_size is not None and s.micro_batch_size < 1:
        p.append(f"micro_batch_size must be positive, got {s.micro_batch_size}")
    if s.tokens_per_micro_batch is not None and s.tokens_per_micro_batch < s.max_seq_len:
        p.append(
            f"tokens_per_micro_batch {s.tokens_per_micro_batch} is below max_seq_len "
            f"{s.max_seq_len}: one full row must fit in a micro-batch"
        )
    return p
