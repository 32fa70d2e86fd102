"""How good is `pitstop estimate`? A short profile's estimate vs the full run it predicts.

    .venv/bin/python -m bench.estimate [--profile-steps 8] [--docs 120]

A tiny Llama (4 layers, width 256, vocab 4096, built locally) and a token store of
the first `--docs` documents of the bundled corpus (max length 256, packed). First a
short run of `--profile-steps` optimizer steps (the "profile"); `pitstop estimate`'s
library then predicts the full one-epoch run from that run's summary.json
(measured trained tokens/s × the store's loss tokens, + the short run's start-up);
then the full epoch runs and its summary.json gives the actual numbers. Also the
peak-memory estimate vs the run's recorded peak (on CPU pitstop records process RSS,
which includes the Python runtime, so expect the estimate below it there). Writes
bench/results/estimate.md.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _config(model_dir: Path, store: Path, out: Path, **extra: Any):
    from pitstop.config import build_config

    values = {
        "model": str(model_dir),
        "data": [str(store)],
        "output": str(out),
        "max_seq_len": 256,
        "tokens_per_step": 2048,
        "micro_batch_size": 4,
        "batching": "pack",
        "log_steps": 5,
        "report_to": ["none"],
        "compile": "off",
        "precision": "fp32",
        "cache_dir": str(out.parent / "cache"),
        "overwrite": True,
        **extra,
    }
    return build_config(values, None, command="train")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile-steps", type=int, default=8)
    ap.add_argument("--docs", type=int, default=120)
    args = ap.parse_args()

    from bench.common import markdown_table, write_result
    from pitstop.config import build_config
    from pitstop.corpus import sample_corpus_path
    from pitstop.data.prepare import prepare_data
    from pitstop.report.estimate import data_tokens, estimate, load_profile
    from pitstop.report.memory import shape_from_model_dir
    from pitstop.tiny import build_model_dir
    from pitstop.train import run

    work = Path(tempfile.mkdtemp(prefix="pitstop-bench-estimate-"))
    model_dir = build_model_dir(work / "model", layers=4, hidden=256, heads=4, vocab_size=4096)
    # A subset of the bundled corpus, prepared the way `pitstop prepare` does.
    import gzip
    import itertools

    subset = work / "subset.jsonl"
    with gzip.open(sample_corpus_path(), "rt", encoding="utf-8") as f, open(subset, "w") as g:
        g.writelines(itertools.islice(f, args.docs))
    prep = prepare_data(
        build_config(
            {
                "data": [str(subset)],
                "model": str(model_dir),
                "max_seq_len": 256,
                "cache_dir": str(work / "cache"),
            },
            command="prepare",
        ),
        progress=False,
    )
    store = prep.store_path

    short = work / "profile-run"
    run(_config(model_dir, store, short, max_steps=args.profile_steps))
    shape = shape_from_model_dir(model_dir)
    est = estimate(
        shape,
        tokens=data_tokens(str(store), None),
        epochs=1,
        seq_len=256,
        micro_batch_size=4,
        precision="fp32",
        profile=load_profile(short),
    )
    full = work / "full-run"
    actual = run(_config(model_dir, store, full, epochs=1))

    startup = est.throughput.startup_seconds
    pred_train = est.train_seconds - startup
    rows = [
        ["train seconds (first step to last)", f"{pred_train:.1f}",
         f"{actual['train_seconds']:.1f}", f"{pred_train / actual['train_seconds']:.2f}"],
        ["wall seconds", f"{est.train_seconds:.1f}", f"{actual['wall_seconds']:.1f}",
         f"{est.train_seconds / actual['wall_seconds']:.2f}"],
        ["trained tokens", f"{est.tokens.trained_tokens:,}", f"{actual['trained_tokens']:,}",
         f"{est.tokens.trained_tokens / actual['trained_tokens']:.2f}"],
        ["peak memory (MB)", f"{est.memory.peak / 1e6:.0f}",
         f"{(actual.get('peak_memory_bytes') or 0) / 1e6:.0f}",
         f"{est.memory.peak / actual['peak_memory_bytes']:.2f}" if actual.get("peak_memory_bytes") else "n/a"],
    ]  # fmt: skip
    table = markdown_table(["", "estimate", "actual", "estimate / actual"], rows)
    body = (
        f"Model: tiny Llama, 4 layers × 256, {shape.params().total:,} parameters; data: "
        f"{args.docs} documents of the bundled corpus ({est.tokens.tokens:,} tokens, "
        f"{est.tokens.trained_tokens:,} carrying loss), packed rows of 256, 2048 tokens per "
        f"step, fp32 on CPU.\n\nProfile: a {args.profile_steps}-step run "
        f"({load_profile(short)['tokens_per_second']:,.0f} trained tokens/s). Basis: "
        f"{est.time_basis}.\n\n{table}\n\nThe memory row compares the estimate's tensor "
        "bytes with the run's recorded peak (process RSS on CPU, which also holds the "
        "Python runtime and libraries); tests/test_estimate_memory_measured.py checks "
        "the tensor bytes alone against a measured RSS delta."
    )
    print(body)
    path = write_result("estimate", "pitstop estimate: short profile vs the full run", body)
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
