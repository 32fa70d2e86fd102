"""How many positions a model was built for, read from its config.json
(`pitstop.catalog.model_config.ModelConfig`, the one reader of it).

Used twice: `pitstop train` refuses rows longer than a learned position table (and
warns past a rotary model's trained length), and `pitstop prepare` never recommends a
max length the model cannot take.
"""

from __future__ import annotations

from pathlib import Path

from pitstop.catalog.model_config import ModelConfig
from pitstop.core.errors import ConfigError


def position_limit(model_dir: str | Path) -> tuple[int | None, bool]:
    """(positions the model was built for, whether they are a learned table) from config.json.

    (None, False) when config.json is absent or names no limit (a tokenizer-only directory).
    """
    config = ModelConfig.read_optional(model_dir)
    if config is None or config.max_position_embeddings is None:
        return None, False
    return config.max_position_embeddings, config.learned_positions


def check_positions(model_dir: str | Path, max_seq_len: int) -> str | None:
    """Refuse rows longer than a learned position table; a note when past a RoPE model's length."""
    limit, learned = position_limit(model_dir)
    if limit is None or max_seq_len <= limit:
        return None
    if learned:
        raise ConfigError(
            f"--max-seq-len {max_seq_len} is longer than the {limit} positions --model "
            f"{model_dir} has (a learned position table, config.json): longer rows would index "
            f"past it and crash. Use --max-seq-len {limit} or less (and prepare the data with it)"
        )
    return (
        f"--max-seq-len {max_seq_len} is past the {limit} positions --model {model_dir} was "
        "trained for (max_position_embeddings): rotary positions run, but quality beyond the "
        "trained length is not guaranteed unless the config sets rope_scaling"
    )
