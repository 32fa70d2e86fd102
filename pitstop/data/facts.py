"""Per-sequence facts of a token store: each sequence's length and trained tokens, 4 bytes each.

Planning an epoch needs, for every sequence, its length and how many loss targets it
trains (its targets after its first token, which nothing in the row predicts). Counting
those from the loss mask reads every token: seconds and, done as one cumulative sum,
gigabytes at 200M tokens, paid again by every start and every rank. So they are counted
once, while prepare writes the store (`chunk_trained`, called by `StoreWriter.append`),
and stored beside it as two little-endian uint32 files of one number per sequence::

    seq_lengths.bin   uint32 [n_sequences]: tokens of each sequence
    seq_trained.bin   uint32 [n_sequences]: its loss targets, its first token left out

read by memory map (`sequence_facts`). A store written before these files existed is
counted once, in bounded memory (spans of whole sequences, `TARGET_SPAN` tokens of mask
at a time), and the files are then written into its directory atomically (a temporary
name, then a rename) so the next start maps them; where the directory is read-only the
counts are kept in memory for this process only.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

__all__ = [
    "FACT_FILES",
    "LENGTHS_FILE",
    "TARGET_SPAN",
    "TRAINED_FILE",
    "SequenceFacts",
    "chunk_trained",
    "count_trained",
    "sequence_facts",
]

LENGTHS_FILE = "seq_lengths.bin"
TRAINED_FILE = "seq_trained.bin"
FACT_FILES = (LENGTHS_FILE, TRAINED_FILE)
FACT_DTYPE = np.dtype("<u4")  # a sequence is at most max_seq_len tokens: far below 2^32
# Tokens of mask summed per pass when an older store is counted: 8 MiB of mask, a 64 MiB sum.
TARGET_SPAN = 1 << 23


class _Store(Protocol):
    """What the facts need of a pitstop.data.store.TokenStore (which imports this module)."""

    path: Path
    offsets: np.ndarray
    mask: np.ndarray

    def __len__(self) -> int: ...


@dataclass(frozen=True)
class SequenceFacts:
    """Each sequence's tokens and trained targets, uint32 [n_sequences] (memory-mapped
    when read from the store's files)."""

    lengths: np.ndarray
    trained: np.ndarray


def chunk_trained(mask: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Trained targets of each sequence of one chunk (the mask of sequences given back to
    back, split by `lengths`): the mask's ones after each sequence's first token, uint32."""
    lengths = np.asarray(lengths, dtype=np.int64)
    csum = np.zeros(len(mask) + 1, dtype=np.int64)
    np.cumsum(np.asarray(mask, dtype=np.uint8), dtype=np.int64, out=csum[1:])
    ends = np.cumsum(lengths)
    starts = ends - lengths
    # min(start + 1, end): an empty sequence counts 0, not its neighbour's first token.
    return (csum[ends] - csum[np.minimum(starts + 1, ends)]).astype(FACT_DTYPE)


def count_trained(mask: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """`chunk_trained` over a whole store's mask, in spans of at most TARGET_SPAN tokens of
    whole sequences: memory is the output plus one span's sum, whatever the store's size."""
    off = np.asarray(offsets, dtype=np.int64)
    n = len(off) - 1
    out = np.empty(max(n, 0), dtype=FACT_DTYPE)
    i = 0
    while i < n:
        # The sequences [i, j) that fit in one span (at least one, however long).
        j = int(np.searchsorted(off, off[i] + TARGET_SPAN, side="right")) - 1
        j = min(n, max(j, i + 1))
        a, b = int(off[i]), int(off[j])
        out[i:j] = chunk_trained(mask[a:b], np.diff(off[i : j + 1]))
        i = j
    return out


def _map(path: Path, n: int) -> np.ndarray | None:
    """The fact file at `path` as a read-only memmap, or None when it is missing or has the
    wrong size (a store written before facts, or a damaged cache: counted again)."""
    try:
        size = path.stat().st_size
    except OSError:
        return None
    if size != n * FACT_DTYPE.itemsize:
        return None
    if n == 0:
        return np.zeros(0, dtype=FACT_DTYPE)
    return np.memmap(path, dtype=FACT_DTYPE, mode="r", shape=(n,))


def _write_atomic(path: Path, values: np.ndarray) -> None:
    # A temporary name in the same directory, then a rename: a reader sees no file or the
    # whole file, and two processes caching the same store write the same bytes.
    tmp = path.with_name(f"{path.name}.partial-{secrets.token_hex(4)}")
    try:
        with open(tmp, "wb") as f:
            f.write(np.ascontiguousarray(values, dtype=FACT_DTYPE).tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def sequence_facts(store: _Store) -> SequenceFacts:
    """The store's per-sequence facts: memory-mapped from its fact files, else counted once
    from its offsets and mask and cached beside it (see the module docstring)."""
    n = len(store)
    lengths = _map(store.path / LENGTHS_FILE, n)
    trained = _map(store.path / TRAINED_FILE, n)
    if lengths is not None and trained is not None:
        return SequenceFacts(lengths, trained)
    offsets = np.asarray(store.offsets, dtype=np.int64)
    counted = SequenceFacts(np.diff(offsets).astype(FACT_DTYPE), count_trained(store.mask, offsets))
    try:
        _write_atomic(store.path / LENGTHS_FILE, counted.lengths)
        _write_atomic(store.path / TRAINED_FILE, counted.trained)
    except OSError:
        return counted  # a read-only store: counted again by the next process
    lengths, trained = _map(store.path / LENGTHS_FILE, n), _map(store.path / TRAINED_FILE, n)
    return SequenceFacts(
        counted.lengths if lengths is None else lengths,
        counted.trained if trained is None else trained,
    )
