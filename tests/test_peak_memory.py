"""A process's recorded peak memory is its own, not the peak of the process that started it.

On Linux `getrusage(RUSAGE_SELF).ru_maxrss` carries the starting process's high-water mark
across exec: a `pitstop train` (or a test's child) started by a 1.5 GiB parent reads 1.5 GiB
before allocating anything. This made tests/test_data_memory.py fail in CI whenever its
pytest worker had earlier peaked above 1 GiB. `pitstop.measure.memory` reads VmHWM instead.
Each test also checks that the trap is real here (the child's ru_maxrss is the parent's),
so it cannot pass by accident on a machine where a wrong reading would look right.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PARENT_MB = 1536

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/status").is_file(), reason="VmHWM needs Linux /proc"
)

# A parent that holds PARENT_MB resident, then runs its arguments as a child and relays
# its output: the shape of a notebook or a test runner starting pitstop.
_FAT_PARENT = f"""
import subprocess, sys
ballast = b"x" * ({PARENT_MB} << 20)
r = subprocess.run(sys.argv[1:], capture_output=True, text=True)
sys.stdout.write(r.stdout); sys.stderr.write(r.stderr); sys.exit(r.returncode)
"""

_CHILD = """
import json, resource
from pitstop.measure.memory import peak_memory
print(json.dumps({"peak_mb": peak_memory("cpu") / 2**20,
                  "ru_maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _env() -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _under_fat_parent(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _FAT_PARENT, *cmd],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=600,
    )


def test_peak_memory_is_the_process_own_under_a_large_parent():
    r = _under_fat_parent(sys.executable, "-c", _CHILD)
    assert r.returncode == 0, r.stderr[-2000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    assert m["ru_maxrss_mb"] >= PARENT_MB, m  # the trap: the parent's peak, inherited
    assert m["peak_mb"] < PARENT_MB / 3, m  # importing pitstop.measure costs far less


@pytest.mark.slow
def test_a_train_run_records_its_own_peak_under_a_large_parent(tiny_model_dir, tmp_path):
    from _train_util import make_store
    from transformers import AutoTokenizer

    store = make_store(tmp_path / "store", AutoTokenizer.from_pretrained(tiny_model_dir))
    out = tmp_path / "out"
    r = _under_fat_parent(
        sys.executable, "-m", "pitstop", "train", "--model", str(tiny_model_dir),
        "--data", str(store), "--output", str(out), "--max-seq-len", "64",
        "--tokens-per-step", "128", "--micro-batch-size", "2", "--max-steps", "2",
        "--log-steps", "1", "--report-to", "none", "--compile", "off", "--precision", "fp32",
        "--cache-dir", str(tmp_path / "cache"),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    peak_mb = summary["peak_memory_bytes"] / 2**20
    # A 2-layer, 64-wide model trains in a few hundred MiB (torch's import is most of it).
    assert 50 < peak_mb < PARENT_MB / 2, summary["peak_memory_bytes"]
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [s["peak_memory_gib"] * 1024 for s in steps if "peak_memory_gib" in s]
    assert logged and all(v < PARENT_MB / 2 for v in logged), logged
