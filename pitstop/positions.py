"""How many positions a model was built for, read from its config.json.

Used twice: `pitstop train` refuses rows longer than a learned position table (and
warns past a rotary model's trained length), and `pitstop prepare` never recommends a
max length the model cannot take.
"""

from __future__ import annotations

import json
from pathlib import Path

from pitstop.errors import ConfigError

# Architectures whose positions are a learned table: a row longer than the table
# indexes past it (an IndexError on CPU, a device-side assert on CUDA).
LEARNED_POSITIONS = frozenset({"gpt2", "gpt_neo", "gpt_bigcode", "opt", "biogpt", "xglm"})


def position_limit(model_dir: str | Path) -> tuple[int | None, bool]:
    """(positions the model was built for, whether they are a learned table) from config.json.

    (None, False) when config.json is absent or names no limit (a tokenizer-only directory).
    """
    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, False
    if not isinstance(raw, dict):
        return None, False
    for key in ("max_position_embeddings", "n_positions", "n_ctx"):
        v = raw.get(key)
        if isinstance(v, int) and v > 0:
            return v, raw.get("model_type") in LEARNED_POSITIONS
    return None, False


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
