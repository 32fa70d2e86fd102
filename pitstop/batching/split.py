"""`--eval-data auto`: a small, deterministic held-out share of the training store.

Whole documents are held out (chunks of a split long document share a doc id, so
no chunk of an evaluated document is ever trained on). A document is held out when
a seeded 64-bit hash of its doc id falls below `share` of the hash range: the
decision depends on that document alone, so it is the same in every run and every
resume, and adding documents to a corpus never moves an existing one across the
split. The hash seed is a constant, not --seed: runs that differ only in their seed
are evaluated on the same documents, so their eval losses compare.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pitstop.core.errors import ConfigError

__all__ = ["HOLDOUT_SHARE", "HeldOut", "holdout_split"]

HOLDOUT_SHARE = 0.02
SPLIT_SEED = 0x5EED_0F_E7A1  # a constant: the split must not move when --seed does

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """Vectorised SplitMix64 finaliser: uint64 -> well-mixed uint64 (wraps on purpose)."""
    with np.errstate(over="ignore"):
        z = (x + np.uint64(0x9E3779B97F4A7C15)) & _M64
        z = ((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _M64
        z = ((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _M64
        return z ^ (z >> np.uint64(31))


@dataclass(frozen=True)
class HeldOut:
    """Sequence ids (sorted int64) of the two sides of the split, and how it was made."""

    train: np.ndarray
    eval: np.ndarray
    n_docs: int
    n_eval_docs: int
    share: float

    def describe(self) -> str:
        return (
            f"auto: {self.n_eval_docs} of {self.n_docs} documents ({len(self.eval)} sequences) held "
            f"out of the training data by a fixed hash of their doc id (~{self.share:.0%}, the same "
            "in every run and resume)"
        )


def holdout_split(doc_ids: np.ndarray, share: float = HOLDOUT_SHARE) -> HeldOut:
    """Split sequences by document: ~`share` of documents (at least one) go to evaluation.

    Raises ConfigError when the store has a single document (nothing would be left to train).
    """
    doc_ids = np.asarray(doc_ids, dtype=np.int64)
    docs = np.unique(doc_ids)
    if len(docs) < 2:
        raise ConfigError(
            f"--eval-data auto needs at least 2 documents in the training data to hold one out; "
            f"it has {len(docs)}. Give a separate --eval-data FILE"
        )
    h = _splitmix64(docs.astype(np.uint64) ^ np.uint64(SPLIT_SEED))
    threshold = np.uint64(min(int(share * 2.0**64), 2**64 - 1))
    held = docs[h < threshold]
    if len(held) == 0:
        held = docs[[int(np.argmin(h))]]  # tiny corpora: the document with the smallest hash
    if len(held) == len(docs):
        held = held[np.argsort(h[np.isin(docs, held)])[:-1]]
    is_eval = np.isin(doc_ids, held)
    return HeldOut(
        train=np.flatnonzero(~is_eval).astype(np.int64),
        eval=np.flatnonzero(is_eval).astype(np.int64),
        n_docs=len(docs),
        n_eval_docs=len(held),
        share=share,
    )
