"""bench/train's bare loop makes the choices pitstop's run made, so the share it reports is
pitstop's loop overhead, not a difference of kernels (until 2026-11-29 it ran fp32 with
foreach AdamW and pitstop read 107% of it)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from bench.train import ceiling_choices


def _summary(precision: str, attention: str = "sdpa_docs", opt: str = "adamw_fused") -> dict:
    return {
        "choices": {
            "precision": {"value": precision, "reason": "r"},
            "attention": {"value": attention, "reason": "r"},
            "optimizer": {"value": opt, "reason": "CPU: fused AdamW"},
        }
    }


def test_the_bare_loop_takes_the_runs_choices() -> None:
    attention, dtype, optimizer = ceiling_choices(_summary("bf16"))
    assert (attention, dtype, optimizer.value) == ("sdpa_docs", torch.bfloat16, "adamw_fused")
    attention, dtype, optimizer = ceiling_choices(_summary("fp32", "sdpa", "adamw_foreach"))
    assert (attention, dtype, optimizer.value) == ("sdpa", None, "adamw_foreach")
    assert ceiling_choices(_summary("fp16"))[1] is torch.float16


@pytest.mark.slow
def test_the_bench_writes_both_sides_choices(tmp_path) -> None:
    """A 3-step run: the table names the choices both loops ran with, as pitstop's summary
    has them, and both rates are positive."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench.train", "--steps", "3", "--repeats", "1",
         "--out", str(tmp_path / "train.md")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    text = (tmp_path / "train.md").read_text()
    assert "optimizer adamw_fused" in text and "attention sdpa_docs" in text, text
    rates = re.findall(r"^\| [^|]+ \| ([\d,]+) \|", text, re.M)
    assert len(rates) == 2 and all(int(r.replace(",", "")) > 0 for r in rates), text
