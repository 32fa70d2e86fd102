"""`pitstop demo`: the embedded default, end to end on whatever device exists.

Builds a tiny Llama and a tokenizer trained on the bundled corpus (no download),
prepares the corpus into a token store, and prints its statistics. Each later
stage (training, profile, findings, cost) joins this flow as it lands.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pitstop.config import build_config
from pitstop.corpus import sample_corpus_path


def run_demo(output: str = "demo-out", seconds: float = 60.0) -> int:
    from pitstop.data.prepare import format_stats, prepare_data
    from pitstop.tiny import build_model_dir

    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    print(f"[demo] building a tiny Llama and its tokenizer in {out / 'model'}", file=sys.stderr)
    model_dir = build_model_dir(out / "model", layers=4, hidden=128, heads=4)
    cfg = build_config(
        {
            "data": [str(sample_corpus_path())],
            "model": str(model_dir),
            "max_seq_len": 512,
            "cache_dir": str(out / "cache"),
        },
        command="prepare",
    )
    print(f"[demo] preparing the bundled corpus ({sample_corpus_path().name})", file=sys.stderr)
    prepared = prepare_data(cfg)
    print(format_stats(prepared.stats))
    print(f"\ntoken store: {prepared.store_path}")
    return 0
