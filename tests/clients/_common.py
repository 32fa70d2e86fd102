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


def prompt_completion_data(data: Path, n: int = 260, test: int = 60) -> Path:
    """A dataset directory TRL's `--dataset_name` reads offline: train.jsonl and test.jsonl
    of prompt/completion records (the first third of each text is the prompt)."""
    data.mkdir(parents=True, exist_ok=True)
    rows = texts(n, 3)
    for name, part in (("train", rows[: n - test]), ("test", rows[n - test :])):
        with (data / f"{name}.jsonl").open("w", encoding="utf-8") as f:
            for x in part:
                w = x.split()
                k = max(1, len(w) // 3)
                rec = {"prompt": " ".join(w[:k]), "completion": " " + " ".join(w[k:])}
                f.write(json.dumps(rec) + "\n")
    return data
