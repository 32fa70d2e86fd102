"""What the real-client programs share: a tiny Llama directory and texts of varied length.

Each program is run by the tests as its users run it (`python PROGRAM ...`, under
`pitstop profile --`); nothing here is pitstop's code path, only the test fixtures'.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def texts(n: int, seed: int = 0) -> list[str]:
    """`n` texts of widely varied length (a few words to a few hundred), so that batches
    padded to their longest row carry a known, large share of padding."""
    import random

    from pitstop.core.corpus import sample_texts

    rng = random.Random(seed)
    pool = " ".join(sample_texts(64)).split()
    out = []
    for _ in range(n):
        k = rng.choice((4, 8, 16, 64, 160))
        start = rng.randrange(0, len(pool) - k)
        out.append(" ".join(pool[start : start + k]))
    return out


def write_truth(path: str | None, **values: Any) -> None:
    if path:
        Path(path).write_text(json.dumps(values), encoding="utf-8")
