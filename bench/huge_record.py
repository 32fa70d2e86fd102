"""Benchmark: peak memory and time of `pitstop prepare` on one huge record.

Run: `python -m bench.huge_record [--mb 64] [--workers 2] [--shape text]`. One JSONL
record of about `--mb` MB of real prose (the bundled KJV corpus, repeated) is prepared
with the tiny byte-level BPE tokenizer (pitstop.tiny) by a real `python -m pitstop
prepare`-equivalent process (the CLI's `main`, with a cold cache). Reported:

- the parent's peak RSS (VmHWM, read in the process at the end);
- the largest peak RSS of its tokenizer workers (RUSAGE_CHILDREN's ru_maxrss);
- the peak of the whole process tree's summed RSS, sampled every 50 ms (pages a forked
  worker shares with the parent are counted once per process, so this overstates it),
  and of its summed PSS (each shared page split among its users: the memory used);
- wall time and tokens.

The promise (issue 33): one 64 MB record prepares in at most 1 GB of RSS; before the
record was tokenized in pieces it took 8.0 GB and 45 s. Writes bench/results/huge_record.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# The child reports its own peak: VmHWM (ru_maxrss would carry over the parent's at exec).
_CHILD = """
import json, resource, sys, time
from pitstop.measure.memory import peak_memory
from pitstop.cli import main
t = time.perf_counter()
rc = main(["prepare", "--model", sys.argv[1], "--data", sys.argv[2], "--cache-dir", sys.argv[3],
           "--workers", sys.argv[4], "--max-seq-len", "2048", "--json"])
print(json.dumps({"rc": rc, "seconds": time.perf_counter() - t,
    "parent_mb": peak_memory("cpu") / 2**20,
    "worker_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""


def write_record(path: Path, mb: float, shape: str) -> int:
    """One JSONL line of about `mb` MB of prose in the given record shape; returns its bytes."""
    from pitstop.core.corpus import sample_texts

    prose = " ".join(sample_texts())
    reps = max(1, int(mb * 2**20 / len(prose.encode())) + 1)
    text = (prose + " ") * reps
    text = text[: int(mb * 2**20)]
    if shape == "text":
        rec = {"text": text}
    elif shape == "completion":
        rec = {"prompt": "Summarise:\n", "completion": text}
    else:
        rec = {
            "messages": [
                {"role": "user", "content": "Recite."},
                {"role": "assistant", "content": text},
            ]
        }
    path.write_text(json.dumps(rec) + "\n", encoding="utf-8")
    return path.stat().st_size


def tree_memory(pid: int) -> tuple[int, int]:
    """(summed RSS, summed PSS) of a process and its children, now."""
    import psutil

    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
    except psutil.Error:
        return 0, 0
    rss = pss = 0
    for q in procs:
        try:
            info = q.memory_full_info()  # PSS shares each shared page among its users
            rss += info.rss
            pss += getattr(info, "pss", info.rss)
        except psutil.Error:
            pass
    return rss, pss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=64.0, help="size of the one record")
    ap.add_argument("--workers", type=int, default=2, help="tokenizer processes")
    ap.add_argument("--shape", choices=("text", "completion", "chat"), default="text")
    args = ap.parse_args()

    from bench.prepare import cpu_model
    from pitstop.tiny import build_model_dir

    work = Path(tempfile.mkdtemp(prefix="pitstop-huge-"))
    try:
        model = build_model_dir(work / "model")
        data = work / "one.jsonl"
        size = write_record(data, args.mb, args.shape)
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PITSTOP_PROGRESS": "0"}
        repo = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [sys.executable, "-c", _CHILD, str(model), str(data), str(work / "cache"),
               str(args.workers)]  # fmt: skip
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        peak_tree = peak_pss = 0

        def sample() -> None:
            nonlocal peak_tree, peak_pss
            while proc.poll() is None:
                rss, pss = tree_memory(proc.pid)
                peak_tree, peak_pss = max(peak_tree, rss), max(peak_pss, pss)
                time.sleep(0.05)

        t = threading.Thread(target=sample, daemon=True)
        t.start()
        out, err = proc.communicate(timeout=1800)
        t.join()
        if proc.returncode != 0:
            sys.exit(f"prepare failed ({proc.returncode}):\n{err[-3000:]}")
        lines = out.strip().splitlines()
        m = json.loads(lines[-1])
        stats = json.loads("\n".join(lines[:-1]))
        text = "\n".join(
            [
                f"Machine: {cpu_model()}, {os.cpu_count()} cores. One {args.shape} record of "
                f"{size / 2**20:.1f} MiB of JSONL ({stats['tokens']:,} tokens, tiny 4096-token "
                f"byte-level BPE), `--workers {args.workers}`, cold cache.",
                "",
                "| measure | value |",
                "|---|---:|",
                f"| wall time (CLI main, imports excluded) | {m['seconds']:.1f} s |",
                f"| parent peak RSS (VmHWM) | {m['parent_mb']:,.0f} MiB |",
                f"| largest worker peak RSS | {m['worker_mb']:,.0f} MiB |",
                f"| process tree, summed RSS, peak of 50 ms samples | {peak_tree / 2**20:,.0f} MiB |",
                f"| process tree, summed PSS (shared pages counted once), peak | {peak_pss / 2**20:,.0f} MiB |",
                "",
                f"Largest single process: {max(m['parent_mb'], m['worker_mb']):,.0f} MiB, "
                f"{max(m['parent_mb'], m['worker_mb']) * 2**20 / size:.1f}x the record "
                "(goal: at most 1 GB at 64 MB).",
            ]
        )
        print(text)
        dest = Path(__file__).parent / "results" / "huge_record.md"
        dest.write_text(
            "# One huge record\n\n`python -m bench.huge_record "
            + " ".join(sys.argv[1:])
            + "`\n\n"
            + text
            + "\n"
        )
        print(f"\nwritten to {dest}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
