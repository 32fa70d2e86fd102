"""Helpers for the batching tests: token stores written directly with StoreWriter.

(No tests here; a module of its own so every test_batching_* file shares one helper.)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pitstop.data.store import StoreWriter, TokenStore


def make_store(
    path: Path,
    lengths: list[int] | np.ndarray,
    *,
    max_seq_len: int,
    vocab: int = 256,
    seed: int = 0,
    target_frac: float = 0.7,
    first_is_target: bool = False,
) -> TokenStore:
    """A store of random sequences with the given lengths; ~target_frac of tokens are targets.

    `first_is_target=True` writes a (contract-breaking) target on every first token,
    to check the batching never trains on it anyway.
    """
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, dtype=np.int64)
    n = int(lengths.sum())
    tokens = rng.integers(3, vocab, n)
    mask = (rng.random(n) < target_frac).astype(np.uint8)
    starts = np.cumsum(lengths) - lengths
    mask[starts] = 1 if first_is_target else 0
    w = StoreWriter(path, vocab_size=vocab)
    w.append(tokens, mask, lengths, np.arange(len(lengths)))
    w.finish({"max_seq_len": max_seq_len, "pad_token_id": 2})
    return TokenStore(path)


def long_tailed_lengths(n: int, max_seq_len: int, seed: int = 0) -> np.ndarray:
    """Lognormal lengths clipped to [2, max_seq_len]: many short sequences, a few long ones."""
    rng = np.random.default_rng(seed)
    x = rng.lognormal(np.log(max_seq_len / 6), 0.9, n).astype(np.int64)
    return np.clip(x, 2, max_seq_len)
