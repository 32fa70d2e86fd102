"""Per-sequence target counts in bounded memory (issue 32): summed over spans of whole
sequences, never one cumulative sum of the whole mask (16 bytes per token: 3.3 GB at 206M
tokens). Same answer as a recount from the mask, whatever the span."""

from __future__ import annotations

import itertools
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from test_batching_support import long_tailed_lengths, make_store

from pitstop.data import store as store_mod


def recount(store: store_mod.TokenStore) -> np.ndarray:
    mask = np.asarray(store.mask, dtype=np.int64)
    off = np.asarray(store.offsets)
    return np.array([mask[a:b].sum() for a, b in itertools.pairwise(off)], dtype=np.int64)


@pytest.mark.parametrize("span", [1, 7, 64, 1000, 1 << 23])
def test_target_counts_equal_a_recount(tmp_path: Path, monkeypatch, span: int) -> None:
    # spans shorter than a sequence, cutting between sequences, and covering the store
    s = make_store(tmp_path / "s", long_tailed_lengths(500, 128), max_seq_len=128)
    monkeypatch.setattr(store_mod, "TARGET_SPAN", span)
    assert np.array_equal(s.target_counts(), recount(s))


def test_target_counts_memory_is_one_span_not_the_store(tmp_path: Path, monkeypatch) -> None:
    lengths = np.full(40_000, 100)  # 4M tokens
    s = make_store(tmp_path / "s", lengths, max_seq_len=128)
    monkeypatch.setattr(store_mod, "TARGET_SPAN", 1 << 16)
    tracemalloc.start()
    counts = s.target_counts()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert counts.sum() == recount(s).sum()
    # 8 bytes per sequence (the answer, the offsets) plus a 64K-token span's int64 sum; a sum
    # over the whole mask would be 8 bytes x 4M tokens = 32 MB.
    assert peak < 3 * 8 * len(lengths) + 2 * 8 * (1 << 16) + (1 << 20), peak
