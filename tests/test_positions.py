"""Rows longer than a model's positions: refused for a learned table, noted for rotary ones,
and never recommended by `pitstop prepare`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pitstop.core.errors import ConfigError
from pitstop.core.positions import check_positions, position_limit
from pitstop.data.stats import compute_stats


def _model(tmp_path: Path, **config) -> Path:
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_a_learned_position_table_refuses_longer_rows(tmp_path: Path) -> None:
    m = _model(tmp_path, model_type="gpt2", n_positions=1024)
    assert position_limit(m) == (1024, True)
    assert check_positions(m, 1024) is None
    with pytest.raises(ConfigError, match=r"--max-seq-len 2048 is longer than the 1024 positions"):
        check_positions(m, 2048)


def test_rotary_positions_past_the_trained_length_are_a_note(tmp_path: Path) -> None:
    m = _model(tmp_path, model_type="llama", max_position_embeddings=512)
    assert position_limit(m) == (512, False)
    note = check_positions(m, 1024)
    assert note and "past the 512 positions" in note and "rope_scaling" in note
    assert position_limit(tmp_path / "missing") == (None, False)


def test_recommended_max_len_never_exceeds_the_model() -> None:
    docs = np.array([3000] * 100 + [100] * 10, dtype=np.int64)  # p99 = 3000 tokens
    free = compute_stats(docs, docs, max_seq_len=512, counts={})["recommended_max_len"]
    assert free["value"] == 4096
    capped = compute_stats(docs, docs, max_seq_len=512, counts={}, model_max_len=1024)
    rec = capped["recommended_max_len"]
    assert rec["value"] == 1024 and "the longest the model takes (1024 positions" in rec["reason"]
    odd = compute_stats(docs, docs, max_seq_len=128, counts={}, model_max_len=200)
    assert odd["recommended_max_len"]["value"] == 200  # below every candidate: the model's own
    # Short documents and a short length given: that length, not the next candidate (256).
    short = np.array([5] * 50 + [3] * 50, dtype=np.int64)
    rec = compute_stats(short, short, max_seq_len=64, counts={})["recommended_max_len"]
    assert rec["value"] == 64 and rec["reason"].startswith("64: the length given, which holds")
    assert (
        compute_stats(short, short, max_seq_len=2048, counts={})["recommended_max_len"]["value"]
        == 256
    )  # a longer one given: the shortest candidate still holds them


def test_train_refuses_before_loading_the_model(tmp_path: Path) -> None:
    from pitstop.core.config import build_config
    from pitstop.train.trainer import Trainer

    m = _model(tmp_path, model_type="gpt2", n_positions=64)
    (m / "model.safetensors").write_bytes(b"")  # never read: the check comes first
    cfg = build_config(
        {"model": str(m), "data": [str(tmp_path / "d.jsonl")], "max_seq_len": 128,
         "output": str(tmp_path / "out")},
        None,
        command="train",
    )  # fmt: skip
    with pytest.raises(ConfigError, match="learned position table"):
        Trainer.from_config(cfg)
