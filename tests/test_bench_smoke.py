"""Smoke tests of the benchmarks' plumbing (never of their timings).

The slow test runs the headline benchmark end to end in its tiny ``--quick`` mode
on a subset of systems (one padded HF peer, TRL, the ceiling) and checks that the
table is produced with a row and a held-out loss per system. The fast tests check
the GPU plan builds without CUDA and that ``run_all`` finds the benchmark modules.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(args: list[str], timeout: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bench.headline", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_headline_quick_writes_the_table(tmp_path: Path) -> None:
    out = tmp_path / "headline.md"
    proc = _run(
        [
            "--quick",
            "--systems",
            "hf_slow,trl,ceiling",
            "--workdir",
            str(tmp_path / "w"),
            "--out",
            str(out),
        ],
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = out.read_text()
    assert "| system |" in text and "held-out loss" in text
    assert "python -m bench.headline --quick" in text  # the exact command is recorded
    results = json.loads((tmp_path / "w" / "results.json").read_text())["results"]
    for name in ("hf_slow", "trl", "ceiling"):
        r = results[name]
        assert r["status"] == "ok", r
        assert isinstance(r["heldout_loss"], float)
        assert r["trained_tokens"] > 0 and r["train_seconds"] > 0
    # Every system trained on exactly the same tokens (the comparison's premise).
    assert len({r["trained_tokens"] for r in results.values()}) == 1


def test_headline_gpu_plan_builds_without_cuda() -> None:
    proc = _run(["--gpu", "--dry-run"], timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = json.loads(proc.stdout)
    assert plan["precision"] == "bf16"
    assert 0.9e9 < plan["parameters"] < 1.5e9


def test_hf_micro_accum_matches_tokens_per_step() -> None:
    from bench.headline import hf_micro_accum

    assert hf_micro_accum(7.0, 8) == (7, 1)
    m, a = hf_micro_accum(55.3, 8)
    assert m <= 8 and abs(m * a - 55.3) <= 1


def test_run_all_discovers_benchmarks() -> None:
    from bench.run_all import discover

    names = discover()
    assert names[0] == "headline"
    assert "common" not in names and "run_all" not in names
