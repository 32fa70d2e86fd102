"""One real `pitstop tune` on the tiny Llama (CPU) with a small budget, through the command."""

from __future__ import annotations

import argparse
import json

import pytest

from pitstop.core.config import build_config, load_yaml
from pitstop.tune.space import resolved_tokens_per_step

pytestmark = pytest.mark.slow


def test_tune_end_to_end_writes_a_train_config(tiny_model_dir, store, cache_dir, tmp_path, capsys):
    from pitstop.commands.tune import register

    parser = argparse.ArgumentParser(prog="pitstop")
    register(parser.add_subparsers(dest="command"))
    tuned = tmp_path / "tuned.yaml"
    args = parser.parse_args([
        "tune", "--model", str(tiny_model_dir), "--data", str(store), "--max-seq-len", "64",
        "--micro-batch-size", "2", "--grad-accum", "4", "--batching", "pack", "--compile", "off",
        "--loader-workers", "0", "--cache-dir", str(cache_dir), "--budget-seconds", "25",
        "--knobs", "micro_batch,batching", "--trial-steps", "6", "--trial-warmup", "1",
        "--output", str(tuned), "--json",
    ])  # fmt: skip
    args.unknown = []
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens_per_step"] == 512  # 2 rows x 4 accumulation x 64
    base, best = out["baseline"], out["best"]
    assert base["settings"]["batching"] == "pack" and base["settings"]["micro_batch_rows"] == 2
    assert base["tokens_per_second"] > 0 and best["tokens_per_second"] > 0
    assert best["peak_memory_bytes"] > 0
    assert out["speedup"] == pytest.approx(best["tokens_per_second"] / base["tokens_per_second"])
    assert len(out["trials"]) >= 1 and out["trials"][0]["status"] == "ok"
    for t in out["trials"]:
        if t["status"] == "ok":
            assert t["tokens_per_step"] == 512  # the training math never moved
            assert t["steps"] >= 1 and t["step_seconds"] > 0
    # a winner other than the start is confirmed side by side with it after the search
    roles = [t["role"] for t in out["trials"]]
    assert roles[0] == "start"
    if best["settings"] != base["settings"]:
        assert out["confirmed"] is True and roles.count("confirm") == 2
        assert best["measurements"] == 1 and best["side_by_side"]["ratio"] > 1
        starts = [t for t in out["trials"] if t["settings"] == base["settings"]]
        assert base["measurements"] == len(starts)  # the start's figure pools all its trials
    else:  # the start won the search, or its winner lost the confirmation: one figure
        assert out["speedup"] == 1.0 and best["measurements"] == base["measurements"] >= 1
        assert out["confirmed"] is None or (out["confirmed"] is False and out["rejected"])
    # the tuned YAML is a complete config that `pitstop train --config` accepts as is
    cfg = build_config(load_yaml(tuned), None, source=str(tuned), command="train")
    assert resolved_tokens_per_step(cfg) == 512 and cfg.grad_accum is None
    assert cfg.tokens_per_micro_batch == best["settings"]["tokens_per_micro_batch"]
    assert cfg.batching == best["settings"]["batching"] and cfg.output
    # search trials are cached for the next tune of the same setup (on a loaded machine the
    # budget can run out after the start and its confirmation: no search trial, no entry)
    if any(t["role"] == "search" for t in out["trials"]):
        assert list((cache_dir / "tune" / "trials").glob("*.json"))


@pytest.mark.parametrize("knobs", [",", " , ", "nope"])
def test_knobs_that_name_nothing_to_try_are_refused(tiny_model_dir, store, knobs, capsys):
    """`--knobs ,` ran a search that could change nothing; an unknown knob is named."""
    from pitstop.cli import main

    rc = main(["tune", "--model", str(tiny_model_dir), "--data", str(store), "--knobs", knobs])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    said = "unknown knob 'nope'" if knobs == "nope" else "--knobs names no knob; give one or more"
    assert said in err, err
