"""Benchmark: `prepare_data` tokens/s against the tokenizer ceiling and `datasets.map`.

Run: `python -m bench.prepare [--mb 30] [--workers N]`. The bundled KJV corpus is
replicated to about `--mb` MB of JSONL, then tokenized three ways with the tiny
BPE tokenizer (pitstop.tiny, trained offline):

- ceiling: `tokenizers` `encode_batch_fast` in one process (no parallelism) on a
  quarter of the texts, times the number of cores: what perfect scaling would give;
- `datasets`: `load_dataset("json")` + `Dataset.map(batched=True, num_proc=cores)`,
  the usual Hugging Face recipe (JSON loading included, as prepare includes it);
- pitstop: `prepare_data` with a cold cache, reading, tokenizing, masking, writing
  the store and computing statistics.

Prints a Markdown table and writes it to bench/results/prepare.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=30.0, help="size of the replicated JSONL corpus")
    ap.add_argument("--workers", type=int, default=0, help="processes (0 = one per core)")
    args = ap.parse_args()
    cores = args.workers or os.cpu_count() or 1

    from pitstop.core.config import RunConfig
    from pitstop.core.corpus import sample_texts
    from pitstop.data.prepare import prepare_data
    from pitstop.tiny import build_model_dir

    work = Path(tempfile.mkdtemp(prefix="pitstop-bench-"))
    try:
        model = build_model_dir(work / "model")
        base = sample_texts()
        block = "".join(json.dumps({"text": t}) + "\n" for t in base)
        reps = max(1, int(args.mb * 2**20 / len(block.encode())))
        data = work / "corpus.jsonl"
        data.write_text(block * reps)
        texts = base * reps
        size_mb = data.stat().st_size / 2**20
        print(f"corpus: {len(texts):,} documents, {size_mb:.1f} MB JSONL, {cores} processes")

        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model)
        sub = texts[: max(1, len(texts) // 4)]
        t, cpu = time.perf_counter(), time.process_time()
        n = 0
        for i in range(0, len(sub), 1000):
            n += sum(len(e.ids) for e in tok.backend_tokenizer.encode_batch_fast(sub[i : i + 1000]))
        one = n / (time.perf_counter() - t)
        one_cpu = n / (time.process_time() - cpu)
        ceiling = one * cores

        import datasets

        datasets.disable_progress_bars()
        t = time.perf_counter()
        ds = datasets.load_dataset(
            "json", data_files=str(data), split="train", cache_dir=str(work / "hf")
        )
        ds = ds.map(lambda b: tok(b["text"]), batched=True, num_proc=cores, remove_columns=["text"])
        ds_tokens = sum(len(x) for x in ds["input_ids"])
        ds_rate = ds_tokens / (time.perf_counter() - t)

        cfg = RunConfig(
            data=[str(data)], model=str(model), cache_dir=str(work / "cache"), workers=cores
        )
        import resource

        c0, s0 = (resource.getrusage(w) for w in (resource.RUSAGE_CHILDREN, resource.RUSAGE_SELF))
        p = prepare_data(cfg, progress=False)
        c1, s1 = (resource.getrusage(w) for w in (resource.RUSAGE_CHILDREN, resource.RUSAGE_SELF))
        ps_rate = p.stats["tokens"] / p.seconds
        # CPU accounting survives a busy machine, where wall-clock ratios do not.
        worker_cpu = c1.ru_utime - c0.ru_utime + c1.ru_stime - c0.ru_stime
        parent_cpu = s1.ru_utime - s0.ru_utime + s1.ru_stime - s0.ru_stime

        rows = [
            ("`tokenizers` encode_batch_fast, 1 process x cores (ceiling)", ceiling, "1.00x"),
            (
                f"`datasets` load_dataset + map(batched, num_proc={cores})",
                ds_rate,
                f"{ds_rate / ceiling:.2f}x",
            ),
            (
                f"pitstop `prepare_data` (workers={cores}, cold cache)",
                ps_rate,
                f"{ps_rate / ceiling:.2f}x",
            ),
        ]
        table = [
            f"Machine: {cpu_model()}, {os.cpu_count()} cores; corpus: bundled KJV x{reps} "
            f"({size_mb:.1f} MB JSONL, {len(texts):,} documents, {p.stats['tokens']:,} tokens), "
            "tiny 4096-token byte-level BPE.",
            "",
            "| method | tokens/s | vs ceiling |",
            "|---|---:|---:|",
            *[f"| {name} | {rate:,.0f} | {ratio} |" for name, rate, ratio in rows],
            "",
            f"pitstop vs datasets.map: {ps_rate / ds_rate:.2f}x; pitstop vs ceiling: "
            f"{ps_rate / ceiling:.2f}x (goal: >= 1.5x and >= 0.8x). pitstop's time includes "
            "hashing the input, masking, writing the store and the statistics.",
            "",
            f"CPU accounting for the pitstop run: workers used {worker_cpu:.1f} CPU-s "
            f"({p.stats['tokens'] / max(worker_cpu, 1e-9):,.0f} tokens per worker CPU-second, "
            f"vs {one_cpu:,.0f} per CPU-second for the bare single-process tokenizer); the parent used {parent_cpu:.1f} CPU-s "
            "(imports, tokenizer load, reading, writing). Load average at the end: "
            f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores.",
        ]
        text = "\n".join(table)
        print(text)
        out = Path(__file__).parent / "results" / "prepare.md"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("# prepare benchmark\n\n" + text + "\n")
        print(f"\nwritten to {out}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
