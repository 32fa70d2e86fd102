"""Peak memory stays bounded whatever the input size (streaming, a bounded window of chunks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import pitstop

INPUT_MB = 16  # 16 chunks of 1 MiB: many windows' worth (it was 40: 2.5x the time, issue 45)
# What prepare may add per process (parent, and the largest worker) to the peak after its
# imports (torch, transformers, the tokenizer: ~330 MB here, more with a CUDA build): ~8x the
# input, which holding the input's tokens would pass (a quarter of a 40 MB input tokenized at
# once peaked 380 MB above the imports, ~38x). Measured: ~20 MB, at 10, 40 and 80 MB of input
# alike. (It was an absolute 1024 MB for an 80 MB input.)
GROWTH_LIMIT_MB = 8 * INPUT_MB

# The parent's peak is read as VmHWM (`peak_memory`): its ru_maxrss would be the pytest
# worker's own peak carried over at exec (tests/test_peak_memory.py). The tokenizer workers
# are forked, not exec'd, so RUSAGE_CHILDREN's ru_maxrss is theirs.
_CHILD = """
import json, resource, sys
from pitstop.measure.memory import peak_memory
from pitstop.core.config import RunConfig
from pitstop.data.prepare import prepare_data
from transformers import AutoTokenizer
AutoTokenizer.from_pretrained(sys.argv[2])  # what prepare loads, measured apart from the data
imports_mb = peak_memory("cpu") / 2**20
p = prepare_data(RunConfig(data=[sys.argv[1]], model=sys.argv[2], cache_dir=sys.argv[3], workers=2), progress=False)
print(json.dumps({"imports_mb": imports_mb, "self_mb": peak_memory("cpu") / 2**20,
                  "children_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
                  "tokens": p.stats["tokens"], "documents": p.stats["documents"]}))
"""


@pytest.mark.slow
def test_peak_rss_bounded_on_a_large_jsonl(tmp_path, tiny_model_dir, cache_dir):
    from pitstop.core.corpus import sample_texts

    lines = [json.dumps({"text": t}) + "\n" for t in sample_texts()]
    block = "".join(lines)
    f = tmp_path / "big.jsonl"
    reps = max(1, (INPUT_MB << 20) // len(block))
    with open(f, "w") as out:
        for _ in range(reps):
            out.write(block)
    env = {**os.environ, "PYTHONPATH": str(Path(pitstop.__file__).parents[1])}
    r = subprocess.run(
        [sys.executable, "-c", _CHILD, str(f), str(tiny_model_dir), str(cache_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    assert m["documents"] == reps * len(lines)
    assert m["self_mb"] - m["imports_mb"] < GROWTH_LIMIT_MB, m
    assert m["children_mb"] - m["imports_mb"] < GROWTH_LIMIT_MB, m
    print(m)
