"""compare + report on two real (tiny) `pitstop train` runs: the contract, end to end."""

from __future__ import annotations

import gzip
import itertools
from pathlib import Path

import pytest

from pitstop.report.compare import compare
from pitstop.report.html import write_report


@pytest.mark.slow
def test_compare_and_report_two_real_runs(tmp_path: Path, tiny_model_dir: Path) -> None:
    from pitstop.core.config import build_config
    from pitstop.core.corpus import sample_corpus_path
    from pitstop.train import run

    data = tmp_path / "d.jsonl"
    with gzip.open(sample_corpus_path(), "rt", encoding="utf-8") as f, open(data, "w") as g:
        g.writelines(itertools.islice(f, 8))
    runs = []
    for batching in ("pad", "pack"):
        out = tmp_path / batching
        cfg = build_config(
            {
                "model": str(tiny_model_dir),
                "data": [str(data)],
                "output": str(out),
                "max_seq_len": 128,
                "tokens_per_step": 512,
                "micro_batch_size": 2,
                "batching": batching,
                "max_steps": 4,
                "log_steps": 2,
                "report_to": ["none"],
                "compile": "off",
                "cache_dir": str(tmp_path / "cache"),
            },
            None,
            command="train",
        )
        run(cfg)
        runs.append(out)
    res = compare(runs[0], runs[1], price=1.0)
    m = {r["metric"]: r for r in res["metrics"]}
    for key in ("tokens_per_second", "iterations_per_second", "wall_seconds", "cost",
                "data_wait_share", "padding_waste", "final_loss"):  # fmt: skip
        assert m[key]["a"] is not None and m[key]["b"] is not None, key
    assert any(d["setting"] == "batching" for d in res["settings_differ"])
    html = write_report(runs, tmp_path / "report.html", price=1.0).read_text()
    assert 'data-chart="loss"' in html and 'data-points="4"' in html
    assert 'class="bar" data-phase="forward"' in html
