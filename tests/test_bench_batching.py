"""bench/batching: auto's pick is judged step against step (every layout trains the same
steps), and a short run of the bench trains layouts as pitstop does and says the verdict."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.batching import pick_verdict


def _layout(name: str, seconds: list[float]) -> dict:
    return {"strategy": name, "seconds": seconds}


def test_a_pick_faster_step_for_step_is_the_fastest() -> None:
    pack = _layout("pack", [1.0, 1.0, 2.0])
    bucket = _layout("bucket", [1.1, 0.9, 2.4])
    text = pick_verdict(pack, [pack, bucket])
    assert text.startswith("**auto's pick, pack, is the measured fastest**"), text
    assert "bucket took 1.10x its seconds" in text and "pack faster in 2" in text


def test_a_pick_slower_step_for_step_is_called_out() -> None:
    """A median over mixed steps could hide it; the paired ratio does not."""
    pack = _layout("pack", [1.0, 3.0, 3.0])
    bucket = _layout("bucket", [1.5, 2.7, 2.7])  # slower on the first step only
    text = pick_verdict(pack, [pack, bucket])
    assert "is not the measured fastest" in text and "bucket took 0.90x" in text, text


def test_unpaired_steps_are_refused() -> None:
    with pytest.raises(ValueError):
        pick_verdict(_layout("pack", [1.0]), [_layout("pack", [1.0]), _layout("pad", [1.0, 2.0])])


@pytest.mark.slow
def test_a_short_run_trains_pitstops_way_and_judges_the_pick(tmp_path) -> None:
    out = tmp_path / "batching.md"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.batching", "--steps", "2", "--layers", "1",
         "--hidden", "64", "--max-seq-len", "128", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    text = out.read_text()
    assert "sdpa_docs attention, pitstop's loss and fused AdamW" in text, text
    assert "spread evenly over the epoch" in text
    assert "**auto's pick, " in text and "median of 2 paired steps" in text, text
