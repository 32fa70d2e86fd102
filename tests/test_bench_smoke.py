"""Smoke tests of the benchmarks' plumbing (never of their timings).

The slow test runs the headline benchmark end to end in its tiny ``--quick`` mode
on a subset of systems (one padded HF peer, TRL, the ceiling) and checks that the
table is produced with a row and a held-out loss per system. The fast tests check
the GPU plan builds without CUDA (the benchmark's main() in this process) and that
``run_all`` finds the benchmark modules.
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
@pytest.mark.long
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
    # The ceiling bounds pitstop's loop, so it takes pitstop's optimizer (a foreach AdamW
    # made the CPU ceiling slower than pitstop's defaults).
    assert "adamw_fused" in results["ceiling"]["config"], results["ceiling"]["config"]
    # Every system trained on exactly the same tokens (the comparison's premise).
    assert len({r["trained_tokens"] for r in results.values()}) == 1


def _dry_run(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    """The GPU plan, printed by the benchmark's own main() in this process: a `python -m
    bench.headline` process loaded torch and transformers again (~20 s on 2 busy cores)."""
    from bench.headline import main

    assert main(["--gpu", "--dry-run", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_headline_gpu_plan_builds_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    plan = _dry_run(capsys)
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


def test_headline_gpu_plan_with_a_32k_vocabulary(capsys: pytest.CaptureFixture[str]) -> None:
    plan = _dry_run(capsys, "--vocab", "32768")
    assert plan["model"]["vocab_size"] == 32768 and plan["model"]["pad_vocab"] is True
    assert plan["systems"] == ["hf_dynamic", "trl", "pitstop", "ceiling"]  # no hf_slow on GPU


def test_headline_sweep_reports_each_systems_best(tmp_path: Path, monkeypatch) -> None:
    """Every micro-batch of the sweep runs; the fastest by the train clock is the system's
    result, the others stay in `sweep` (their models deleted), and a size that does not split
    the packed step is skipped with the reason."""
    import bench.headline as h

    setup = h.Setup(
        mode="gpu", quick=False, model_dir="m", train_file="t", heldout_file="h", max_len=1024,
        tokens_per_step=12 * 1024, lr=1e-3, seed=0, precision="bf16", attn="sdpa",
        n_train_docs=10, n_heldout_docs=2, train_seen_tokens=1, mean_doc_len=512.0, hf_micro=1,
        hf_accum=24, hf_workers=4, trl_micro_rows=1, trl_accum=12, timeout_s=10, sweep=[4, 8, 16],
    )  # fmt: skip
    seconds = {4: 10.0, 8: 5.0, 16: 8.0}

    def fake(setup, workdir, system, micro=None):
        final = tmp_path / f"{system}-{micro}"
        final.mkdir()
        return {"system": system, "status": "ok", "trained_tokens": 1000, "config": f"{micro}",
                "train_seconds": seconds[micro], "wall_seconds": 20.0, "model_dir": str(final),
                "peak_memory_bytes": micro * 2**30}  # fmt: skip

    monkeypatch.setattr(h, "run_child_system", fake)
    res = h.run_sweep(setup, tmp_path, "hf_dynamic")
    assert res["micro"] == 8 and res["train_seconds"] == 5.0
    assert res["config"].startswith("best of micro-batch 4/8/16")
    assert [p["micro"] for p in res["sweep"]] == [4, 8, 16]
    assert (tmp_path / "hf_dynamic-8").is_dir() and not (tmp_path / "hf_dynamic-4").exists()
    trl = h.run_sweep(setup, tmp_path, "trl")  # 12 rows per step: 8 and 16 do not split it
    assert [p["status"] for p in trl["sweep"]] == ["ok", "n/a", "n/a"] and trl["micro"] == 4
    note = h.sweep_notes({"hf_dynamic": res})[0]
    assert "8: 200 / 50 tok/s, 8.0 GiB" in note and "4: 100" in note
