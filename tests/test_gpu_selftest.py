"""`python -m bench.gpu_selftest`: a clean "no CUDA device" exit on the CPU, its packed
check runs here, and on a GPU every check passes (`pytest -m gpu`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def test_without_cuda_it_says_so_and_exits_cleanly() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "bench.gpu_selftest"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "no CUDA device" in r.stdout
    assert "Traceback" not in r.stderr


def test_the_packed_rows_run_on_the_cpu() -> None:
    from bench import gpu_selftest as st

    rows = st.check_packed(torch.device("cpu"), "fp32")
    by = {r.check: r.status for r in rows}
    assert by["packed attention: sdpa"] == "pass" and by["packed attention: eager"] == "pass"
    assert by["packed attention: flash_attention_2"] == "skip"
    assert "FAIL" not in st.table(rows)


def test_a_crashing_check_is_a_failed_row_and_the_rest_still_run(monkeypatch) -> None:
    from bench import gpu_selftest as st

    def boom(dev, precision):
        raise RuntimeError("kaput")

    def fine(dev, precision):
        return [st.Row("fine", "pass", "ok")]

    monkeypatch.setattr(st, "CHECKS", [boom, fine])
    rows = st.run_checks(torch.device("cpu"), "fp32")
    assert [r.status for r in rows] == ["FAIL", "pass"] and "kaput" in rows[0].detail


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_every_gpu_check_passes() -> None:
    from bench import gpu_selftest as st

    rows = st.run_checks(torch.device("cuda"), "bf16")
    failed = [r for r in rows if r.status == "FAIL"]
    assert not failed, st.table(rows)
