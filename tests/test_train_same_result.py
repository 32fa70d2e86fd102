"""Same config, same result: layouts share the step plan; `auto` is measured once and reused.

Tiny Llama runs on CPU with one intra-op thread (one reduction order), fp32.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def short_store(tmp_path_factory, tiny_tokenizer):
    """Sequences of at most 24 tokens (and shorter tails) for rows of 64: layouts differ."""
    from _train_util import make_store

    return make_store(tmp_path_factory.mktemp("short") / "s", tiny_tokenizer, max_len=24)


class _StopAfter:
    """StepHooks: a run planned long (so `auto` finds timing worth it) that ends after `n`."""

    def __init__(self, n: int) -> None:
        self.n, self.started = n, 0

    def step_started(self) -> bool:
        self.started += 1
        return self.started >= self.n

    def step_ended(self, step: int) -> None:
        pass


def _fit(model: Path, store: Path, out: Path, stop_after: int | None = None, **over) -> dict:
    from _train_util import train_config

    from pitstop.train.trainer import Trainer

    hooks = _StopAfter(stop_after) if stop_after else None
    return Trainer.from_config(train_config(model, store, out, **over), hooks=hooks).fit().to_json()


def _metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "final" / "model.safetensors")


def _same_weights(a: Path, b: Path) -> bool:
    wa, wb = _weights(a), _weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_every_layout_and_micro_batch_size_trains_the_same_steps(
    tiny_model_dir, short_store, tmp_path
):
    store = short_store
    runs = {}
    for strategy in ("pack", "bucket", "pad"):
        for mbs in (1, 4):
            out = tmp_path / f"{strategy}-{mbs}"
            _fit(tiny_model_dir, store, out, batching=strategy, micro_batch_size=mbs,
                 max_steps=4, log_steps=1)  # fmt: skip
            runs[(strategy, mbs)] = _metrics(out)
    ref = runs[("pad", 1)]
    ref_losses = [r["loss"] for r in ref]
    ref_tokens = [r["step_trained_tokens"] for r in ref]
    assert len(ref) == 4 and all(t > 0 for t in ref_tokens)
    for key, lines in runs.items():
        # The same documents in every step: the same trained tokens, the same loss up to
        # the order of floating-point sums (micro-batch and row grouping).
        assert [r["step_trained_tokens"] for r in lines] == ref_tokens, key
        for a, b in zip([r["loss"] for r in lines], ref_losses):
            assert a == pytest.approx(b, rel=1e-5), key
    positions = {k: v[-1]["padded_tokens"] for k, v in runs.items()}
    assert max(positions[("pack", 1)], positions[("bucket", 4)]) < positions[("pad", 1)]  # differ
    # Re-running the same choice is bit-identical.
    again = tmp_path / "pack-4-again"
    _fit(tiny_model_dir, store, again, batching="pack", micro_batch_size=4, max_steps=4,
         log_steps=1)  # fmt: skip
    assert [r["loss"] for r in _metrics(again)] == [r["loss"] for r in runs[("pack", 4)]]
    assert _same_weights(again, tmp_path / "pack-4")


DEFAULTS = {"batching": "auto", "micro_batch_size": None, "tokens_per_step": None, "max_steps": 4}


# A dense-mask kernel, so `batching: auto` times the layouts (with the default per-document
# kernel a cost model decides untimed: the next test); planned long enough that timing pays
# back (batching/payoff.py), and stopped after 4 steps.
TIMED = {**DEFAULTS, "attention": "sdpa", "max_steps": 100_000, "stop_after": 4}


def test_default_runs_decide_the_layout_untimed_and_the_second_reuses(
    tiny_model_dir, store, tmp_path, capsys
):
    s1 = _fit(tiny_model_dir, store, tmp_path / "a", **DEFAULTS)
    err1 = capsys.readouterr().err
    s2 = _fit(tiny_model_dir, store, tmp_path / "b", **DEFAULTS)
    err2 = capsys.readouterr().err
    assert "measuring batching layouts" not in err1 + err2
    assert s1["choices"]["attention"]["value"] == "sdpa_docs"
    assert s1["choices"]["batching"]["value"] == "pack"
    assert ": cost model, not timed" in s1["choices"]["batching"]["reason"]
    m1, m2 = s1["measured_choices"], s2["measured_choices"]
    assert (m1["source"], m2["source"]) == ("measured", "reused")
    assert m1["measurements"]["rounds"] == 0 and m1["measurements"]["timings"] == {}
    assert [r["loss"] for r in _metrics(tmp_path / "a")] == [
        r["loss"] for r in _metrics(tmp_path / "b")
    ]
    assert _same_weights(tmp_path / "a", tmp_path / "b")


def test_two_timed_runs_end_bit_identical_and_the_second_reuses(
    tiny_model_dir, store, tmp_path, capsys
):
    s1 = _fit(tiny_model_dir, store, tmp_path / "a", **TIMED)
    err1 = capsys.readouterr().err
    s2 = _fit(tiny_model_dir, store, tmp_path / "b", **TIMED)
    err2 = capsys.readouterr().err
    assert "measuring batching layouts: round 1" in err1 and "measured 20" in err1
    assert "measuring batching layouts" not in err2 and "reused, measured 20" in err2
    m1, m2 = s1["measured_choices"], s2["measured_choices"]
    assert (m1["source"], m2["source"]) == ("measured", "reused")
    assert m1["values"] == m2["values"] == {"batching": s1["choices"]["batching"]["value"]}
    assert m1["measured_at"] == m2["measured_at"] and m1["measurements"]["rounds"] >= 3
    assert [r["loss"] for r in _metrics(tmp_path / "a")] == [
        r["loss"] for r in _metrics(tmp_path / "b")
    ]
    assert _same_weights(tmp_path / "a", tmp_path / "b")
    # The run directory records what it resolved; --remeasure measures again.
    rec = json.loads((tmp_path / "b" / "choices.json").read_text())
    assert rec["values"] == m1["values"]
    s3 = _fit(tiny_model_dir, store, tmp_path / "c", remeasure=True, **TIMED)
    assert s3["measured_choices"]["source"] == "measured"
    assert "measuring batching layouts: round 1" in capsys.readouterr().err


def test_resume_takes_the_runs_choices_never_the_cache(
    tiny_model_dir, store, tmp_path, monkeypatch
):
    import shutil

    from pitstop.train.trainer import RunInterrupted

    out = tmp_path / "cut"
    monkeypatch.setenv("PITSTOP_TEST_STOP_AT_STEP", "2")
    with pytest.raises(RunInterrupted):
        _fit(tiny_model_dir, store, out, **DEFAULTS)
    monkeypatch.delenv("PITSTOP_TEST_STOP_AT_STEP")
    rec = json.loads((out / "choices.json").read_text())
    chosen = rec["values"]["batching"]
    full = tmp_path / "full"
    s = _fit(tiny_model_dir, store, full, **DEFAULTS)  # the uninterrupted run, same choice
    assert s["choices"]["batching"]["value"] == chosen
    # Then the cached entry changes (another start re-measured and ranked differently): a
    # new run would take it; a resumed run must continue with what it started with.
    entry = tmp_path / "cache" / "choices" / f"{rec['key']}.json"
    other = next(k for k in ("pack", "bucket", "pad") if k != chosen)
    entry.write_text(json.dumps({**json.loads(entry.read_text()), "values": {"batching": other}}))
    shutil.rmtree(out / "checkpoints")  # as if killed before its first checkpoint
    r = _fit(tiny_model_dir, store, out, resume=True, **DEFAULTS)
    assert r["choices"]["batching"]["value"] == chosen
    assert r["measured_choices"]["source"] == "run"
    assert "kept from this run" in r["choices"]["batching"]["reason"]
    assert [x["loss"] for x in _metrics(out)] == [x["loss"] for x in _metrics(full)]
    assert _same_weights(out, full)
    fresh = _fit(tiny_model_dir, store, tmp_path / "fresh", **DEFAULTS)
    assert fresh["choices"]["batching"]["value"] == other  # the cache is what a new run reads
