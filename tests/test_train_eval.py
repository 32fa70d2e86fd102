"""Held-out evaluation, the fractional epoch over several epochs, and the wandb reporter."""

from __future__ import annotations

import itertools
import json
import math
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pitstop.probe import DeviceInfo

CPU = DeviceInfo(type="cpu", name="test cpu", cpu_count=2)


# The shared `store` fixture (tests/conftest.py) builds a 12-chapter store here.
STORE_DOCS = 12


@pytest.fixture(scope="module")
def eval_store(tmp_path_factory, tiny_tokenizer):
    from _train_util import make_store

    return make_store(tmp_path_factory.mktemp("eval") / "e", tiny_tokenizer, n_docs=3)


def _cfg(model, store, out, **over):
    from _train_util import train_config

    return train_config(model, store, out, **over)


def _metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_eval_loss_equals_a_hand_computation(tiny_model_dir, store, eval_store, tmp_path):
    from pitstop.data.store import TokenStore
    from pitstop.train.trainer import Trainer

    cfg = _cfg(tiny_model_dir, store, tmp_path / "out", eval_data=str(eval_store), eval_steps=2)
    tr = Trainer.from_config(cfg, device=CPU)
    res = tr.evaluate()
    assert tr.run.model.training  # evaluation puts the model back in training mode
    # By hand: every eval sequence alone (batch of one, positions from 0), CE summed over its
    # targets (the store's mask, never the first token), divided by all targets.
    es = TokenStore(eval_store)
    total, n = 0.0, 0
    tr.run.model.eval()
    with torch.no_grad():
        for i in range(len(es.lengths)):
            a, b = int(es.offsets[i]), int(es.offsets[i + 1])
            ids = torch.as_tensor(np.asarray(es.tokens[a:b], dtype=np.int64))[None]
            target = torch.as_tensor(np.asarray(es.mask[a:b], dtype=bool))
            target[0] = False
            logits = tr.run.model(input_ids=ids).logits[0, :-1].float()
            ce = F.cross_entropy(logits, ids[0, 1:], reduction="none")
            total += float(ce[target[1:]].sum())
            n += int(target[1:].sum())
    assert res["eval_targets"] == n and res["eval_sequences"] == len(es.lengths)
    assert res["eval_loss"] == pytest.approx(total / n, rel=1e-5)
    assert res["eval_ppl"] == pytest.approx(math.exp(total / n), rel=1e-5)


@pytest.mark.slow
def test_eval_auto_run_logs_times_and_keeps_the_best(tiny_model_dir, store, tmp_path, capsys):
    from pitstop.train import run

    out = tmp_path / "out"
    s = run(_cfg(tiny_model_dir, store, out, eval_data="auto", eval_steps=2, save_steps=2,
                 save_total_limit=1, max_steps=4, report_to=["tensorboard"]))  # fmt: skip
    lines = _metrics(out)
    assert [("eval_loss" in r) for r in lines] == [False, True, False, True]
    for r in (lines[1], lines[3]):
        assert r["eval_ppl"] == pytest.approx(math.exp(r["eval_loss"]))
        assert r["eval_targets"] > 0 and r["eval_seconds"] > 0
    assert lines[2]["eval_s"] > 0  # the evaluation after step 2 is timed in step 3's phases
    assert s["time_breakdown"]["eval"] > 0
    assert s["eval_loss"] == lines[3]["eval_loss"] and s["eval_ppl"] == lines[3]["eval_ppl"]
    assert s["eval"]["step"] == 4
    best = json.loads((out / "checkpoints" / "best.json").read_text())
    assert best["eval_loss"] == min(lines[1]["eval_loss"], lines[3]["eval_loss"])
    kept = sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir())
    assert kept == sorted({"step-4", f"step-{best['step']}"})  # newest 1 + the best
    err = capsys.readouterr().err
    assert "held out of the training data" in err and "not implemented" not in err
    # the held-out documents never trained: trained tokens fall short of the whole store's
    assert s["choices"]["eval"]["value"].startswith("auto:")


@pytest.mark.slow
def test_epoch_fraction_over_two_epochs(tiny_model_dir, tmp_path):
    from test_batching_support import make_store

    from pitstop.train import run

    small = make_store(tmp_path / "small", [40] * 12, max_seq_len=64).path  # 3 steps per epoch
    out = tmp_path / "out"
    s = run(_cfg(tiny_model_dir, small, out, max_steps=None, epochs=2, log_steps=1))
    lines = _metrics(out)
    per_epoch = len(lines) // 2
    assert per_epoch >= 2 and len(lines) == 2 * per_epoch
    epochs = [r["epoch"] for r in lines]
    assert epochs[per_epoch - 1] == pytest.approx(1.0)  # end of epoch 0
    assert epochs[per_epoch] == pytest.approx(1 + 1 / per_epoch)  # not 1 + (per_epoch+1)/per_epoch
    assert epochs[-1] == pytest.approx(2.0) and s["epochs"] == pytest.approx(2.0)
    assert all(a < b for a, b in itertools.pairwise(epochs))


def test_wandb_not_installed_is_a_one_line_notice(tiny_model_dir, tmp_path, monkeypatch, capsys):
    from pitstop.train.run_log import NullRun, open_wandb

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    cfg = _cfg(tiny_model_dir, tmp_path / "s", tmp_path / "out", report_to=["wandb"])
    run, note = open_wandb(cfg, tmp_path / "out", True)
    assert isinstance(run, NullRun) and "not installed" in note
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "wandb" in err and "pip install wandb" in err
    run.log({"train/loss": 1.0}, step=1)  # a no-op, never an error
    run.finish()


def test_wandb_gets_the_run_config_and_honours_its_mode(tiny_model_dir, tmp_path, monkeypatch):
    from pitstop.train.run_log import open_wandb

    calls: dict = {}
    fake = types.ModuleType("wandb")

    def init(**kw):
        calls.update(kw)
        return types.SimpleNamespace(log=lambda d, step: None, finish=lambda: None)

    fake.init = init  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = _cfg(tiny_model_dir, tmp_path / "s", tmp_path / "out", report_to=["wandb"])
    _, note = open_wandb(cfg, tmp_path / "out", True)
    assert note == f"mode offline, run {calls['id']}"  # the id --resume continues
    assert calls["dir"] == str(tmp_path / "out") and calls["config"]["lr"] == cfg.lr
    run, note = open_wandb(cfg, tmp_path / "out", False)  # other ranks never start a run
    assert "rank 0" in note and type(run).__name__ == "NullRun"
