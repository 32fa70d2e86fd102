"""Attention FLOPs follow the documents' lengths, not max_seq_len, for packed rows.

The FLOPs formula's attention term is 12·L·d·T per position (the PaLM accounting: a
position attending over T positions). A packed row of documents n_1..n_k attends
sum(n_i^2) pairs, not T^2: counting T overstated the MFU of packed runs of short documents.
T is now the epoch's mean attention span, sum of squared segments / positions, where the
segments are laid out as collate lays them out (each document; padding continues the row's
last one); max_seq_len stays where the lengths are unknown.
"""

from __future__ import annotations

import numpy as np
import pytest

from pitstop.batching.plan import measure_efficiency
from pitstop.batching.settings import BatchSettings
from pitstop.measure.cost_model import FlopsModel
from pitstop.probe import DeviceInfo

CPU = DeviceInfo(type="cpu", name="test cpu", cpu_count=2)
FM = FlopsModel(n_trainable=1000, n_frozen=0, n_layers=2, d_model=64)
ATTN = 12 * FM.n_layers * FM.d_model  # 12·L·d: FLOPs per position per attended position


def _attention_flops(lengths: list[int], strategy: str = "pack", msl: int = 8) -> float:
    """Attention FLOPs of one epoch: positions x the attention term at the epoch's span."""
    lens = np.asarray(lengths, dtype=np.int64)
    eff = measure_efficiency(lens, BatchSettings(strategy, msl, 16, micro_batch_size=1))
    span = eff.attention_span
    return eff.positions * (FM.per_token(span) - FM.per_token(0))


def test_shorter_packed_documents_cost_fewer_attention_flops():
    # The same 16 tokens in two rows of 8: as 4 documents of 4, or 8 documents of 2.
    four = _attention_flops([4, 4, 4, 4])  # rows [4 4] [4 4]: 4 x 4^2 = 64 pairs
    two = _attention_flops([2] * 8)  # rows [2 2 2 2] x 2: 8 x 2^2 = 32 pairs
    assert four == ATTN * 64 == 98_304
    assert two == ATTN * 32 == 49_152
    # Counting each row as 8 x 8, as before: 2 x 64 = 128 pairs whatever the documents.
    assert FM.per_token(8) * 16 - FM.per_token(0) * 16 == ATTN * 128


def test_padding_continues_the_last_document_of_its_row():
    # rows [3 3 + 2 padding] x 2: segments 3 and 5 per row (collate's cu_seqlens).
    assert _attention_flops([3, 3, 3, 3]) == ATTN * 2 * (3**2 + 5**2)


def test_one_document_per_row_attends_over_the_whole_row():
    # pad: every row is one document padded to 8, its padding continuing it: 8^2 per row.
    assert _attention_flops([2] * 8, strategy="pad") == ATTN * 8 * 8**2


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_tokenizer):
    """Documents cut into sequences of at most 16 tokens: four or more to a row of 64."""
    from _train_util import make_store

    path = tmp_path_factory.mktemp("attnflops") / "s"
    return make_store(path, tiny_tokenizer, n_docs=20, max_len=16)


def _loader(tiny_model_dir, store, out, **over):
    from _train_util import train_config

    from pitstop.batching.resolve import BatchRequest
    from pitstop.data.store import TokenStore
    from pitstop.train import data as data_mod

    cfg = train_config(tiny_model_dir, store, out, **over)
    return data_mod.build_loader(
        BatchRequest(cfg, TokenStore(cfg.data[0]), out=out, cache_dir=cfg.cache_dir)
    )


@pytest.mark.parametrize("strategy", ["pack", "bucket", "pad"])
def test_the_span_is_what_collate_lays_out(tiny_model_dir, store, tmp_path, strategy):
    """The plan's arithmetic against the micro-batches themselves: sum of squared
    cu_seqlens segments over every position of epoch 0."""
    from pitstop.batching.collate import collate

    loader, geo = _loader(tiny_model_dir, store, tmp_path / "out", batching=strategy,
                          micro_batch_size=None, tokens_per_micro_batch=128)  # fmt: skip
    squares = positions = 0
    for step in range(loader.steps_in_epoch(0)):
        for spec in loader.micro_batches(step):
            mb = collate(loader.store.tokens, loader.store.mask, loader.store.offsets, spec,
                         loader.pad_id)  # fmt: skip
            seg = np.diff(mb["cu_seqlens"].numpy().astype(np.int64))
            squares += int((seg * seg).sum())
            positions += int(mb["input_ids"].numel())
    assert geo.attention_span == pytest.approx(squares / positions, rel=1e-12)
    if strategy == "pack":  # sequences of at most 16 tokens, padding on the last
        assert geo.attention_span < 0.5 * geo.max_seq_len
    if strategy == "pad":
        assert geo.attention_span == geo.max_seq_len


def test_the_runs_flops_per_token_use_the_span(tiny_model_dir, store, tmp_path):
    from _train_util import train_config

    from pitstop.train.build import build_run

    run = build_run(train_config(tiny_model_dir, store, tmp_path / "out"), device=CPU)
    geo = run.geometry
    assert geo.strategy == "pack" and geo.attention_span < 0.5 * geo.max_seq_len
    assert run.flops_per_token == run.flops.per_token(geo.attention_span)
    assert run.flops_per_token < run.flops.per_token(geo.max_seq_len)


def test_unknown_lengths_keep_max_seq_len():
    from pitstop.train.data import Geometry

    assert Geometry("custom", 2048, 0, "given").flops_seq_len == 2048.0
