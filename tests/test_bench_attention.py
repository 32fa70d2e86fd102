"""The attention benchmark's plumbing on the CPU (never its timings): `--cpu-smoke` runs
every backend that can run here on a packed multi-row micro-batch and writes the table."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import attention as bench


def test_the_micro_batch_is_packed_and_multi_row() -> None:
    mb = bench.packed_micro_batch(rows=3, max_len=64, vocab=256, seed=0)
    assert mb["input_ids"].shape == (3, 64)
    cu = mb["cu_seqlens"].tolist()
    assert len(cu) - 1 > 3  # more documents than rows: some row holds several
    assert cu[-1] == 3 * 64


def test_gpu_mode_without_cuda_says_so(capsys) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    with pytest.raises(SystemExit) as e:
        bench.main(["--gpu"])
    assert e.value.code == 2
    assert "--gpu needs a CUDA device" in capsys.readouterr().err


@pytest.mark.slow
def test_cpu_smoke_writes_the_table(tmp_path: Path) -> None:
    out = tmp_path / "attention.md"
    assert bench.main(["--cpu-smoke", "--repeats", "1", "--out", str(out)]) == 0
    rows = {}
    for line in out.read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == len(bench.HEADERS) and cells[1] in bench.BACKENDS:
            rows[cells[1]] = cells
    assert set(rows) == set(bench.BACKENDS)
    assert rows["sdpa"][2] == "fwd+bwd" and rows["sdpa"][-1] == "reference"
    assert rows["flex_attention"][2] == "fwd only"  # no FlexAttention backward on the CPU
    for name in ("flex_attention", "eager"):
        assert float(rows[name][-1]) < 1e-5, rows[name]  # the same loss as sdpa's
    assert rows["flash_attention_2"][-1].startswith("skipped: flash-attn needs a CUDA GPU")
