"""How good is `pitstop estimate`? A short profile's estimate vs the full run it predicts.

    .venv/bin/python -m bench.estimate [--profile-steps 10] [--docs 120] [--repeats 3]

What a user does, each command in its own process: a short `pitstop train
--max-steps P` (the "profile"), then `pitstop estimate --from-profile RUN_DIR --json`
for one epoch of the same data and settings, then the full one-epoch `pitstop train`.
The model is a tiny Llama (4 layers, width 256, vocab 4096, built locally) and the
data a token store of the first `--docs` documents of the bundled corpus (max length
256, packed). The estimate's train_seconds (start-up included) and its start-up are
compared with the full run's wall_seconds and train_seconds (first step to last).
`--repeats` pairs, one after another; the goal is the median pair within 15%, and
every pair is shown. Also the peak-memory estimate vs the run's recorded peak (on CPU
pitstop records process RSS, which includes the Python runtime, so expect the
estimate below it there). Writes bench/results/estimate.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

GOAL = 0.15
RUN_FLAGS = [
    "--max-seq-len", "256", "--tokens-per-step", "2048", "--micro-batch-size", "4",
    "--batching", "pack", "--log-steps", "5", "--report-to", "none", "--compile", "off",
    "--precision", "fp32", "--overwrite",
]  # fmt: skip


def _pitstop(*args: str) -> str:
    env = {**os.environ, "PITSTOP_PROGRESS": "0"}
    out = subprocess.run(
        [sys.executable, "-m", "pitstop", *args], env=env, capture_output=True, text=True
    )
    if out.returncode != 0:
        raise SystemExit(f"pitstop {args[0]} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return out.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile-steps", type=int, default=10)
    ap.add_argument("--docs", type=int, default=120)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from bench.common import markdown_table, write_result
    from pitstop.core.config import build_config
    from pitstop.core.corpus import sample_corpus_path
    from pitstop.data.prepare import prepare_data
    from pitstop.measure.cost_model import shape_from_model_dir
    from pitstop.tiny import build_model_dir

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
    store = str(prep.store_path)
    common = ["--model", str(model_dir), "--data", store, "--cache-dir", str(work / "cache")]
    pairs = []
    for r in range(1, args.repeats + 1):
        short, full = work / f"profile-{r}", work / f"full-{r}"
        _pitstop("train", *common, *RUN_FLAGS, "--output", str(short),
                 "--max-steps", str(args.profile_steps))  # fmt: skip
        est_args = ["estimate", "--model", str(model_dir), "--data", store, "--epochs", "1",
                    "--from-profile", str(short), "--micro-batch-size", "4",
                    "--precision", "fp32", "--json"]  # fmt: skip
        est = json.loads(_pitstop(*est_args))
        _pitstop("train", *common, *RUN_FLAGS, "--output", str(full), "--epochs", "1")
        actual = json.loads((full / "summary.json").read_text())
        t = est["time"]
        pred_train = t["train_seconds"] - t["startup_seconds"]
        pairs.append({
            "pred_wall": t["train_seconds"], "pred_train": pred_train,
            "wall": actual["wall_seconds"], "train": actual["train_seconds"],
            "ratio": pred_train / actual["train_seconds"],
            "wall_ratio": t["train_seconds"] / actual["wall_seconds"],
            "tokens": t["trained_tokens_per_epoch"], "actual_tokens": actual["trained_tokens"],
            "peak_est": est["memory"]["peak_bytes"], "peak": actual.get("peak_memory_bytes"),
            "basis": t["basis"],
        })  # fmt: skip
        print(f"pair {r}: estimate {pred_train:.1f} s vs actual {actual['train_seconds']:.1f} s "
              f"({pairs[-1]['ratio']:.2f})", flush=True)  # fmt: skip

    med = statistics.median(p["ratio"] for p in pairs)
    ok = abs(med - 1) <= GOAL
    rows = [
        [i, f"{p['pred_train']:.1f}", f"{p['train']:.1f}", f"{p['ratio']:.2f}",
         f"{p['pred_wall']:.1f}", f"{p['wall']:.1f}", f"{p['wall_ratio']:.2f}"]
        for i, p in enumerate(pairs, 1)
    ]  # fmt: skip
    table = markdown_table(
        ["pair", "estimate train s", "actual train s", "ratio", "estimate wall s",
         "actual wall s", "wall ratio"], rows,
    )  # fmt: skip
    last = pairs[-1]
    shape = shape_from_model_dir(model_dir)
    body = (
        f"Model: tiny Llama, 4 layers × 256, {shape.params().total:,} parameters; data: "
        f"{args.docs} documents of the bundled corpus ({last['tokens']:,} trained tokens per "
        f"epoch; the full run trained {last['actual_tokens']:,}), packed rows of 256, 2048 "
        f"tokens per step, fp32 on CPU. Each pair: a {args.profile_steps}-step `pitstop train` "
        "(the profile), `pitstop estimate --from-profile` it, then the full one-epoch "
        "`pitstop train`, each in its own process.\n\n"
        f"{table}\n\n"
        f"- median estimate / actual train seconds: **{med:.2f}** "
        f"({'PASS' if ok else 'FAIL'}: goal within {GOAL:.0%})\n"
        f"- basis of the last estimate: {last['basis']}\n"
        f"- peak memory: estimate {last['peak_est'] / 1e6:.0f} MB of tensors vs "
        f"{(last['peak'] or 0) / 1e6:.0f} MB recorded (process RSS on CPU, which also holds the "
        "Python runtime and libraries); tests/test_estimate_memory_measured.py checks the "
        "tensor bytes alone against a measured RSS delta."
    )
    print(body)
    path = write_result("estimate", "pitstop estimate: short profile vs the full run", body)
    print(f"\nwritten to {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
