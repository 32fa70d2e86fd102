"""Per-sequence facts stored with the token store (issue 32): each sequence's length and
trained targets are written by prepare and memory-mapped at start-up; a store written
before them is counted once and cached beside it."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from test_batching_support import long_tailed_lengths, make_store

from pitstop.batching.loader import MicroBatchLoader, sequence_targets
from pitstop.batching.settings import BatchSettings
from pitstop.core.errors import DataError
from pitstop.data import facts as facts_mod
from pitstop.data.facts import FACT_FILES, chunk_trained, sequence_facts
from pitstop.data.store import StoreWriter, TokenStore


def recount(store: TokenStore) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, trained) from the tokens and mask, one sequence at a time."""
    off = np.asarray(store.offsets)
    mask = np.asarray(store.mask, dtype=np.int64)
    lengths = np.diff(off)
    trained = np.array([mask[a + 1 : b].sum() for a, b in itertools.pairwise(off)], np.int64)
    return lengths, trained


def _old_format(path: Path) -> None:
    """Make a store look written by the previous format: no fact files, none in its manifest."""
    for name in FACT_FILES:
        (path / name).unlink()
    m = json.loads((path / "manifest.json").read_text())
    for name in FACT_FILES:
        del m["checksums"][name]
    (path / "manifest.json").write_text(json.dumps(m))


def test_written_facts_equal_a_recount(tmp_path: Path) -> None:
    # first_is_target: a target on every first token, which trained must leave out
    s = make_store(
        tmp_path / "s", long_tailed_lengths(700, 128), max_seq_len=128, first_is_target=True
    )
    assert all((s.path / n).stat().st_size == 4 * len(s) for n in FACT_FILES)
    f = sequence_facts(s)
    assert isinstance(f.trained, np.memmap)  # read from the store, not counted
    lengths, trained = recount(s)
    assert np.array_equal(f.lengths, lengths)
    assert np.array_equal(f.trained, trained)
    assert trained.sum() > 0
    assert np.array_equal(sequence_targets(s), trained)


def test_facts_of_appends_in_several_chunks(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    w = StoreWriter(tmp_path / "s", vocab_size=300)
    for _ in range(4):
        lengths = rng.integers(1, 40, 50)
        n = int(lengths.sum())
        w.append(rng.integers(0, 300, n), rng.integers(0, 2, n), lengths, np.arange(50))
    w.finish({"max_seq_len": 64})
    s = TokenStore(tmp_path / "s")
    lengths, trained = recount(s)
    f = sequence_facts(s)
    assert np.array_equal(f.lengths, lengths) and np.array_equal(f.trained, trained)


def test_chunk_trained_empty_and_one_token_sequences() -> None:
    mask = np.array([1, 1, 1, 0, 1], np.uint8)
    # sequences: [1], [], [1, 1], [0, 1]; an empty one counts nothing of its neighbour's
    assert chunk_trained(mask, np.array([1, 0, 2, 2])).tolist() == [0, 0, 1, 1]


@pytest.mark.parametrize("span", [1, 50, 1 << 23])
def test_old_format_store_loads_and_gets_its_facts(tmp_path: Path, monkeypatch, span) -> None:
    s = make_store(
        tmp_path / "s", long_tailed_lengths(400, 128), max_seq_len=128, first_is_target=True
    )
    want = sequence_facts(s)
    want = (np.array(want.lengths), np.array(want.trained))
    _old_format(s.path)
    monkeypatch.setattr(facts_mod, "TARGET_SPAN", span)  # spans inside and across sequences
    old = TokenStore(s.path)
    f = sequence_facts(old)
    assert np.array_equal(f.lengths, want[0]) and np.array_equal(f.trained, want[1])
    assert np.array_equal(f.trained, recount(old)[1])
    # cached beside the store, so the next start maps them instead of counting
    assert all((s.path / n).stat().st_size == 4 * len(old) for n in FACT_FILES)
    assert not list(s.path.glob("*.partial-*"))
    monkeypatch.setattr(facts_mod, "count_trained", lambda *a: pytest.fail("counted again"))
    again = sequence_facts(TokenStore(s.path))
    assert isinstance(again.trained, np.memmap)
    assert np.array_equal(again.trained, want[1])
    # and a loader over the old store plans as over the new one
    settings = BatchSettings("pack", 128, 1024, micro_batch_size=2)
    assert MicroBatchLoader(old, settings).steps_per_epoch > 1


def test_unwritable_old_store_counts_in_memory(tmp_path: Path, monkeypatch) -> None:
    s = make_store(tmp_path / "s", long_tailed_lengths(100, 64), max_seq_len=64)
    _old_format(s.path)

    def refuse(path: Path, values: np.ndarray) -> None:
        raise PermissionError(13, "read-only", str(path))  # as a read-only directory does

    monkeypatch.setattr(facts_mod, "_write_atomic", refuse)
    f = sequence_facts(TokenStore(s.path))
    assert np.array_equal(f.trained, recount(s)[1])
    assert not (s.path / FACT_FILES[0]).exists()


def test_damaged_fact_file_named_in_manifest_is_refused(tmp_path: Path) -> None:
    s = make_store(tmp_path / "s", long_tailed_lengths(100, 64), max_seq_len=64)
    p = s.path / FACT_FILES[1]
    data = bytearray(p.read_bytes())
    data[0] ^= 1
    p.write_bytes(bytes(data))
    with pytest.raises(DataError, match="checksum"):
        TokenStore(s.path)
    p.write_bytes(bytes(data[:-4]))
    with pytest.raises(DataError, match="bytes"):
        TokenStore(s.path)
