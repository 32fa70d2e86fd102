"""Planning an epoch of 10 million documents fits a stated memory bound (issue 32): the
step plan, the pack layout and what the plan keeps cost PLAN_BYTES_PER_DOC bytes per
document at their peak, measured as the peak RSS of a fresh process (tracemalloc slows
the per-sequence row fill ~30-fold)."""

from __future__ import annotations

import json
import subprocess
import sys

N_DOCS = 10_000_000
# Measured 40 bytes per document (pack) and 51 (bucket) with tracemalloc at 1M documents:
# order, lengths in planned order, the fill's array and flags, the gathered rows.
PLAN_BYTES_PER_DOC = 64

_CHILD = """
import json, resource, sys
import numpy as np
from pitstop.batching.plan import build_plan
n, strategy = int(sys.argv[1]), sys.argv[2]
rng = np.random.default_rng(0)
lengths = np.empty(n, dtype=np.int64)
for a in range(0, n, 1 << 20):  # in blocks, so making them does not set the peak
    b = min(n, a + (1 << 20))
    lengths[a:b] = np.clip(rng.lognormal(np.log(75), 1.0, b - a), 2, 512)
trained = lengths - 1
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
plan = build_plan(lengths, strategy=strategy, max_seq_len=512, tokens_per_step=8192, seed=0,
                  epoch=0, trained=trained)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"peak_kb": after - before, "steps": plan.n_steps, "seqs": len(plan.seqs)}))
"""


def test_planning_ten_million_documents_fits_the_bound() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(N_DOCS), "bucket"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["seqs"] == N_DOCS and got["steps"] > 100_000
    per_doc = got["peak_kb"] * 1024 / N_DOCS
    assert per_doc <= PLAN_BYTES_PER_DOC, f"{per_doc:.1f} bytes per document"
