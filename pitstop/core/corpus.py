"""The bundled sample corpus: the King James Bible, one record per chapter.

Public domain text, taken from Debian's `bible-kjv-text` package by
`scripts/build_corpus.py` (rerun it to rebuild). 1,189 chapters from 2 to 176
verses: real prose with the long-tailed length distribution of real fine-tuning
data, small enough (1.3 MB compressed) to ship, so the demo, tests and
benchmarks never need a download.
"""

from __future__ import annotations

import gzip
import json
from importlib import resources
from pathlib import Path
from typing import Any

CORPUS_FILE = "kjv_chapters.jsonl.gz"


def sample_corpus_path() -> Path:
    """Path of the bundled corpus file (`.jsonl.gz`, one `{"text": ...}` record per chapter)."""
    return Path(str(resources.files("pitstop") / "assets" / CORPUS_FILE))


def load_sample_corpus(limit: int | None = None) -> list[dict[str, Any]]:
    """Records of the bundled corpus, in canonical order (Genesis 1 first)."""
    out = []
    with gzip.open(sample_corpus_path(), "rt", encoding="utf-8") as f:
        for line in f:
            out.append(json.loads(line))
            if limit is not None and len(out) >= limit:
                break
    return out


def sample_texts(limit: int | None = None) -> list[str]:
    return [r["text"] for r in load_sample_corpus(limit)]


def instruction_records(limit: int | None = None) -> list[dict[str, str]]:
    """Prompt/completion records made from the corpus: recite a chapter from its first verse.

    Real text with a long-tailed completion length, for exercising prompt masking
    and packing on instruction-shaped data.
    """
    out = []
    for r in load_sample_corpus(limit):
        head, _, body = r["text"].partition("\n\n")
        first, _, rest = body.partition("\n")
        if not rest:
            continue
        out.append(
            {
                "prompt": f"Continue {head} after its first verse:\n{first}\n",
                "completion": rest,
            }
        )
    return out
