"""Prepare's statistics from counts per length (issue 32): equal to the same statistics
computed from an array with one length per document, and flat in memory as documents grow."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from pitstop.core.packing import bfd_arrays, bfd_bin_count
from pitstop.data.stats import LengthCounts, compute_stats, pack_efficiency, padding_waste


def _lengths(rng: np.random.Generator, n: int, cap: int, kind: int) -> np.ndarray:
    if kind == 0:
        return rng.integers(1, cap + 1, n)
    if kind == 1:  # long-tailed, as real documents
        return np.clip(rng.lognormal(np.log(cap / 8), 1.0, n).astype(np.int64), 1, cap)
    return rng.choice(rng.integers(1, cap + 1, 5), n)  # few distinct lengths


@pytest.mark.parametrize("seed", range(60))
def test_bin_count_equals_the_item_by_item_packing(seed: int) -> None:
    rng = np.random.default_rng(seed)
    cap = int(rng.choice([16, 64, 100, 512, 2048]))
    lengths = _lengths(rng, int(rng.integers(0, 3000)), cap, seed % 3)
    _, bounds = bfd_arrays(lengths, cap)
    values, counts = np.unique(lengths, return_counts=True)
    assert bfd_bin_count(values, counts, cap) == len(bounds) - 1


def _array_stats(d: np.ndarray) -> dict:
    """The statistics as they were computed from one length per document."""
    return {
        "mean": round(float(d.mean()), 1),
        **{f"p{p}": int(np.quantile(d, p / 100, method="inverted_cdf")) for p in (50, 90, 95, 99)},
        "max": int(d.max()),
    }


@pytest.mark.parametrize("seed", range(20))
def test_counted_statistics_equal_the_per_document_ones(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    d = np.clip(rng.lognormal(np.log(200), 1.2, int(rng.integers(1, 5000))), 1, 30000)
    d = d.astype(np.int64)
    counted = LengthCounts()
    for chunk in np.array_split(d, 7):  # as prepare adds them, chunk by chunk
        counted.add(chunk)
    stats = compute_stats(counted, counted, max_seq_len=512, counts={})
    assert stats["document_length"] == _array_stats(d)
    for w in stats["padding_waste"]:
        rows = int(np.maximum(1, -(-d // w["max_len"])).sum())
        assert w["rows"] == rows and w["docs_split"] == int((d > w["max_len"]).sum())
        assert w["padding_fraction"] == round(1 - d.sum() / (rows * w["max_len"]), 4)
    split = np.concatenate([[512] * int(n // 512) + ([n % 512] if n % 512 else []) for n in d])
    _, bounds = bfd_arrays(split.astype(np.int64), 512)
    assert stats["packing"]["rows"] == len(bounds) - 1
    assert pack_efficiency(d, 512) == pack_efficiency(counted, 512)
    assert padding_waste(d, 1024) == padding_waste(counted, 1024)
    rec = stats["recommended_max_len"]
    assert rec["documents_whole"] == round(float((d <= rec["value"]).mean()), 4)


def test_counting_holds_the_distinct_lengths_not_the_documents() -> None:
    """10M documents of long-tailed length, added in chunks as prepare does: the counts
    stay a few kilobytes (an array of lengths would be 80 MB)."""
    rng = np.random.default_rng(0)
    counted = LengthCounts()
    tracemalloc.start()
    try:
        for _ in range(100):
            chunk = np.clip(rng.lognormal(np.log(120), 1.0, 100_000), 1, 20000).astype(np.int64)
            counted.add(chunk)
            del chunk
        tracemalloc.reset_peak()
        counted.add(np.array([5, 7, 9]))
        kept = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(counted) == 10_000_003
    assert counted.values.nbytes + counted.counts.nbytes < 400_000
    assert kept < 1_000_000, kept
