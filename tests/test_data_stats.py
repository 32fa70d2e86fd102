"""Statistics: exact best-fit-decreasing packing, padding waste, the recommendation, the table."""

from __future__ import annotations

import json

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pitstop.data.stats import compute_stats, format_stats, pack_efficiency, padding_waste


def naive_bfd_rows(lengths: list[int], cap: int) -> int:
    items = []
    for n in lengths:
        items += [cap] * (n // cap) + ([n % cap] if n % cap else [])
    bins: list[int] = []  # free space per bin
    for s in sorted(items, reverse=True):
        best = min((i for i, f in enumerate(bins) if f >= s), key=lambda i: bins[i], default=None)
        if best is None:
            bins.append(cap - s)
        else:
            bins[best] -= s
    return len(bins)


@given(st.lists(st.integers(1, 100), min_size=1, max_size=80), st.sampled_from([8, 16, 37, 64]))
@settings(max_examples=200, deadline=None)
def test_pack_matches_item_by_item_bfd(lengths, cap):
    eff, rows = pack_efficiency(np.array(lengths), cap)
    assert rows == naive_bfd_rows(lengths, cap)
    assert abs(eff - sum(lengths) / (rows * cap)) < 1e-12


def test_pack_many_items_fast():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 2048, size=1_000_000)
    eff, rows = pack_efficiency(lengths, 2048)
    assert 0.98 < eff <= 1 and rows >= lengths.sum() / 2048


def test_padding_waste_splits_long_docs():
    w = padding_waste(np.array([100, 300]), 256)
    assert w["rows"] == 3 and w["docs_split"] == 1
    assert abs(w["padding_fraction"] - (1 - 400 / 768)) < 1e-4


def test_recommendation_and_table():
    d = np.array([100] * 98 + [900, 3000])
    counts = {
        "documents": 100,
        "sequences": 100,
        "tokens": int(d.sum()),
        "target_tokens": 1,
        "bad_records": 0,
        "bad_examples": [],
        "record_kinds": {"text": 100},
        "long_documents": {"policy": "split", "count": 1, "extra_chunks": 2, "targets_lost": 2},
    }
    s = compute_stats(d, np.minimum(d, 1024), max_seq_len=1024, counts=counts)
    assert s["recommended_max_len"]["value"] == 1024  # p99 = 900
    assert s["document_length"]["p99"] == 900 and s["document_length"]["max"] == 3000
    assert [w["max_len"] for w in s["padding_waste"]] == [256, 512, 1024, 2048, 4096, 8192]
    json.dumps(s)
    table = format_stats(s)
    for text in (
        "documents",
        "padding waste",
        "<- --max-seq-len",
        "recommended --max-seq-len 1024",
        "best-fit decreasing",
        "packing (--batching pack) removes padding",
    ):
        assert text in table
