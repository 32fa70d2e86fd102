"""Start-up memory of each rank under torchrun (issue 32): the data side of a training rank.

    .venv/bin/python -m bench.scale_ranks STORE [STORE ...] [--nproc 2]

For each token store (prepare them first, e.g. with `python -m bench.scale --keep`), one
process and then `--nproc` processes under torchrun (gloo) each do what a training rank
does with the data before its first step: open the store (its checksum check included),
build the loader for its rank of that world size (the step plan of epoch 0, pack, rows of
512, 8192 tokens per step) and read its first micro-batch. Each rank reports its peak
resident memory (VmHWM) above what it held after its imports. Writes
bench/results/scale_ranks.md.

What it shows: each rank keeps only its share of the plan (batching/rank_plan.py): it still
fills every row of the epoch (one pass in which each row depends on the earlier ones), a
block of steps at a time, handing the shuffle's memory back as it goes; beyond its share it
maps the store's per-document facts (8 bytes per document, pages the ranks on a machine
share).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import REPO_ROOT, markdown_table, write_result
from bench.scale import MSL, TPS  # the shape bench/scale trains: one place

_RANK = f"""
import json, os, sys
import numpy as np, torch
from pitstop.batching.loader import LoaderOptions, MicroBatchLoader
from pitstop.batching.settings import BatchSettings
from pitstop.data.store import TokenStore
from pitstop.measure.memory import peak_memory


def hwm():
    return peak_memory("cpu")


base = hwm()
world = int(os.environ.get("WORLD_SIZE", "1"))
rank = int(os.environ.get("RANK", "0"))
if world > 1:
    import torch.distributed as dist
    dist.init_process_group("gloo")
store = TokenStore(sys.argv[1], verify="background")
settings = BatchSettings("pack", {MSL}, {TPS}, micro_batch_size=4, world_size=world)
loader = MicroBatchLoader(store, settings, LoaderOptions(workers=0), rank=rank)
steps = loader.steps_per_epoch
next(iter(loader))
out = {{"rank": rank, "world": world, "grown": hwm() - base, "steps": steps}}
with open(os.path.join(sys.argv[2], f"rank{{rank}}.json"), "w") as f:
    json.dump(out, f)
if world > 1:
    dist.barrier()
    dist.destroy_process_group()
"""


def run(store: Path, nproc: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "rank.py"
        script.write_text(_RANK)
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
        if nproc == 1:
            cmd = [sys.executable, str(script), str(store), tmp]
        else:
            run_ = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            cmd = [*run_, f"--nproc-per-node={nproc}", str(script), str(store), tmp]
        subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=1800)
        return [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("stores", nargs="+", type=Path, help="token store directories")
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args()
    rows = []
    for store in args.stores:
        n = json.loads((store / "manifest.json").read_text())["n_sequences"]
        one = run(store, 1)[0]
        ranks = run(store, args.nproc)
        each = ", ".join(f"{r['grown'] / 1e6:.0f}" for r in ranks)
        share = one["grown"] / args.nproc / 1e6
        rows.append([f"{n:,}", f"{one['grown'] / 1e6:.0f}", each, f"{share:.0f}"])
        print(json.dumps({"sequences": n, "one": one, "ranks": ranks}), flush=True)
    body = markdown_table(
        [
            "sequences",
            "one process (MB)",
            f"each of {args.nproc} ranks (MB)",
            "a rank's share (MB)",
        ],
        rows,
    )
    body += (
        "\n\nPeak resident memory above the process's imports while it opens the store, plans "
        f"epoch 0 (pack, rows of {MSL}, {TPS} tokens per step) and reads its first micro-batch "
        "as that rank; torchrun with gloo. Each rank keeps its share of the plan "
        "(batching/rank_plan.py); beyond it a rank maps the store's per-document facts (8 bytes "
        "per document, pages shared by the ranks on a machine).\n"
    )
    path = write_result("scale_ranks", "Start-up memory per rank under torchrun", body)
    print(body)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
