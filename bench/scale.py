"""Scale: prepare and start-up time and peak memory from 0.1M to 10M documents (issue 32).

    .venv/bin/python -m bench.scale [--sizes 0.1,1,10] [--workers 0]

For each size (millions of documents) a synthetic JSONL is generated (words of the
bundled corpus, a long-tailed length: lognormal, median ~55 words), then, as separate
processes measured by `/usr/bin/time -v` (wall seconds, peak RSS):

- `pitstop prepare` of it into a fresh cache;
- `pitstop train` of the 7.6M-parameter tiny Llama the other benchmarks use (4 layers,
  width 256, 4096-token vocabulary) on it, store cached: `--max-seq-len 512
  --tokens-per-step 8192 --max-steps 3`; time to the first step is the moment the
  `step 1/3` line appears minus step 1's own duration (metrics.jsonl), as bench/startup;
- the loader's resume: a process opening the store and planning as train does (pack,
  512, 8192) then reading its first micro-batch at step 0 and, in another process, at
  90% of the epoch (`load_state_dict`): the data side of `--resume`, without a checkpoint.

Then the growth per million documents between the smallest and largest size. The
machine is shared in development, so seconds are noisy; bytes are not. Writes
bench/results/scale.md. 10M documents take ~15 min of prepare on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import REPO_ROOT, markdown_table, write_result

MSL, TPS, STEPS = 512, 8192, 3
MEDIAN_WORDS = 55


def write_corpus(path: Path, n_docs: int, seed: int = 0) -> int:
    """`n_docs` JSONL records of bundled-corpus words, lognormal lengths (median 55 words,
    up to ~20x that); returns the words written. Built in blocks of 100,000 documents
    from one pool of words, so the file, not the memory, grows with n_docs."""
    from pitstop.core.corpus import sample_texts

    words = " ".join(sample_texts()).split()
    rng = np.random.default_rng(seed)
    pool = np.asarray(words, dtype=object)
    total = 0
    with open(path, "w", encoding="utf-8") as f:
        for start in range(0, n_docs, 100_000):
            k = min(100_000, n_docs - start)
            counts = np.clip(rng.lognormal(np.log(MEDIAN_WORDS), 1.0, k), 1, 4000).astype(int)
            at = rng.integers(0, len(pool) - 4001, k)
            lines = [
                json.dumps({"text": " ".join(pool[a : a + c])})
                for a, c in zip(at, counts, strict=True)
            ]
            f.write("\n".join(lines) + "\n")
            total += int(counts.sum())
    return total


def timed(
    cmd: list[str], env: dict[str, str], mark: str = ""
) -> tuple[float, float, list[str], float]:
    """(wall seconds, peak RSS in GB, stderr lines, seconds until a stderr line starting
    with `mark` appeared) of `cmd` under /usr/bin/time -v."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(["/usr/bin/time", "-v", *cmd], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    lines, seen = [], -1.0
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if mark and seen < 0 and line.startswith(mark):
            seen = time.perf_counter() - t0
    wall = time.perf_counter() - t0
    if proc.wait() != 0:
        sys.exit("\n".join([" ".join(cmd), *lines[-40:]]))
    rss_kb = next(int(x.split(":")[1]) for x in lines if "Maximum resident set size" in x)
    return wall, rss_kb * 1024 / 1e9, lines, seen


_RESUME = f"""
import sys, time
from pitstop.batching.loader import LoaderOptions, MicroBatchLoader
from pitstop.batching.settings import BatchSettings
store, frac = sys.argv[1], float(sys.argv[2])
t = time.perf_counter()
loader = MicroBatchLoader(store, BatchSettings("pack", {MSL}, {TPS}, micro_batch_size=4),
                          LoaderOptions(workers=0))
steps = loader.steps_per_epoch
if frac:
    state = loader.state_dict()
    state.update(global_step=int(steps * frac), step=int(steps * frac))
    loader.load_state_dict(state)
next(iter(loader))
print("RESUME", time.perf_counter() - t, steps)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="0.1,1", help="millions of documents, comma-separated")
    ap.add_argument("--workers", type=int, default=0, help="prepare workers (0: its default)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument(
        "--work",
        type=Path,
        help="work in this directory and keep it: a size whose JSONL and store are already "
        "there is not written or prepared again (its prepare columns read 'reused'), so the "
        "start-up of 10M documents can be measured again without ~20 min of prepare",
    )
    args = ap.parse_args()
    sizes = [float(x) for x in args.sizes.split(",")]
    from pitstop.tiny import build_model_dir

    work = args.work or Path(tempfile.mkdtemp(prefix="pitstop-bench-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    keep = args.keep or args.work is not None
    env = {**os.environ, "PITSTOP_PROGRESS": "0", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    py = sys.executable
    try:
        model = work / "model"
        if not (model / "config.json").exists():
            build_model_dir(model, layers=4, hidden=256, heads=4, vocab_size=4096)
        results = []
        for size in sizes:
            n = round(size * 1e6)
            data, cache = work / f"docs-{n}.jsonl", work / f"cache-{n}"
            counted = data.with_suffix(".words")
            if data.exists() and counted.exists():  # --work: written by an earlier run
                words = int(counted.read_text())
            else:
                words = write_corpus(data, n)
                counted.write_text(str(words))
            reused = any(cache.rglob("manifest.json"))
            prep = [py, "-m", "pitstop", "prepare", "--data", str(data), "--model", str(model),
                    "--cache-dir", str(cache), "--max-seq-len", str(MSL), "--quiet"]  # fmt: skip
            if args.workers:
                prep += ["--workers", str(args.workers)]
            prep_s, prep_gb, _, _ = timed(prep, env)
            if reused:
                prep_s = prep_gb = None  # a cache hit, not a prepare: not reported as one
            os.sync()  # the store's pages reach the disk now, not during the train timing
            store = next(p.parent for p in cache.rglob("manifest.json"))
            manifest = json.loads((store / "manifest.json").read_text())
            out = work / f"run-{n}"
            train = [py, "-m", "pitstop", "train", "--model", str(model), "--data", str(data),
                     "--cache-dir", str(cache), "--output", str(out), "--max-seq-len", str(MSL),
                     "--tokens-per-step", str(TPS), "--max-steps", str(STEPS), "--log-steps",
                     "1", "--report-to", "none"]  # fmt: skip
            train_s, train_gb, lines, seen = timed(train, env, mark=f"step 1/{STEPS}")
            step1 = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
            first = seen - float(step1["step_seconds"])  # as bench/startup
            resume = {}
            for frac in (0.0, 0.9):
                _, gb, lines, _ = timed([py, "-c", _RESUME, str(store), str(frac)], env)
                line = next(x for x in lines if x.startswith("RESUME"))
                resume[frac] = (float(line.split()[1]), gb, int(line.split()[2]))
            row = {
                "docs": n, "words": words, "tokens": int(manifest["n_tokens"]),
                "sequences": int(manifest["n_sequences"]), "prepare_s": prep_s,
                "prepare_gb": prep_gb, "train_s": train_s, "train_gb": train_gb,
                "first_step_s": first, "loader_step0_s": resume[0.0][0],
                "loader_step0_gb": resume[0.0][1], "resume_late_s": resume[0.9][0],
                "resume_late_gb": resume[0.9][1], "steps_per_epoch": resume[0.9][2],
            }  # fmt: skip
            results.append(row)
            print(json.dumps(row), flush=True)
            shutil.rmtree(out, ignore_errors=True)
            if not keep:
                data.unlink()
        _report(results)
    finally:
        if keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def _num(x: float | None, digits: int) -> str:
    return "reused" if x is None else f"{x:.{digits}f}"


def _report(rows: list[dict]) -> None:
    table = markdown_table(
        ["documents", "tokens", "prepare (s)", "prepare peak RSS (GB)", "train 3 steps (s)",
         "time to first step (s)", "train peak RSS (GB)", "loader at step 0 (s)",
         "loader resume at 90% (s)", "resume peak RSS (GB)"],
        [[f"{r['docs']:,}", f"{r['tokens']:,}", _num(r["prepare_s"], 1), _num(r["prepare_gb"], 2),
          f"{r['train_s']:.1f}", f"{r['first_step_s']:.1f}", f"{r['train_gb']:.2f}",
          f"{r['loader_step0_s']:.2f}", f"{r['resume_late_s']:.2f}", f"{r['resume_late_gb']:.2f}"]
         for r in rows],
    )  # fmt: skip
    body = table + "\n"
    if len(rows) > 1:
        a, b = rows[0], rows[-1]
        per = (b["docs"] - a["docs"]) / 1e6

        def g(k: str) -> float:
            return (b[k] - a[k]) / per

        prepared = (
            "reused"
            if None in (a["prepare_s"], b["prepare_s"])
            else (f"{g('prepare_s'):+.1f} s and {g('prepare_gb') * 1e3:+.0f} MB peak")
        )
        body += (
            f"\nGrowth per million documents ({a['docs']:,} -> {b['docs']:,}): prepare "
            f"{prepared}; train time to "
            f"the first step {g('first_step_s'):+.1f} s and {g('train_gb') * 1e3:+.0f} MB peak "
            f"RSS; loader resume at 90% {g('resume_late_s'):+.2f} s.\n"
        )
    body += (
        f"\nSynthetic JSONL (bundled-corpus words, lognormal length, median {MEDIAN_WORDS} "
        f"words), tiny Llama (4 layers, width 256), `--max-seq-len {MSL} --tokens-per-step "
        f"{TPS} --max-steps {STEPS}`, default batching (auto). Peak RSS from /usr/bin/time -v "
        "(it counts the memory-mapped store pages a process touched). The development "
        "machine is shared: seconds are noisy, compare sizes within one run.\n"
    )
    path = write_result("scale", "Scale: prepare and start-up from 0.1M to 10M documents", body)
    print(body)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
