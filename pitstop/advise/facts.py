"""Facts the rules need about the model and the data, read cheaply and defensively.

Model: `config.json` for the shape, and the safetensors headers for the exact
parameter count (a header is a few KB of JSON at the start of each file; no
weights are read). Data: a token store's manifest "stats" (written by
`pitstop prepare`, see pitstop/data/stats.py) and its per-sequence lengths.
Anything missing or malformed yields None, and the rules that need it stay quiet.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pitstop.data.stats import padding_waste
from pitstop.data.store import TokenStore


@dataclass(frozen=True)
class ModelFacts:
    n_params: int  # every parameter
    n_embedding: int  # input-embedding parameters that are only a lookup (not tied to the output)
    n_layers: int
    d_model: int
    vocab_size: int

    @property
    def n_dense(self) -> int:
        """Parameters that cost matmul FLOPs (pitstop/measure/flops.py's N)."""
        return self.n_params - self.n_embedding

    def flops_per_token(self, seq_len: int) -> float:
        """6·N + 12·L·d·T, the training FLOPs per token pitstop uses everywhere."""
        return 6.0 * self.n_dense + 12.0 * self.n_layers * self.d_model * seq_len


def _safetensors_shapes(path: Path) -> dict[str, list[int]]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100_000_000:
            raise ValueError("implausible safetensors header")
        header = json.loads(f.read(n))
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


def model_facts(model_dir: str | Path | None) -> ModelFacts | None:
    """Shape and parameter count of a local HF model directory, or None."""
    if not model_dir:
        return None
    d = Path(model_dir)
    try:
        cfg = json.loads((d / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    text = cfg.get("text_config") or cfg
    layers = int(text.get("num_hidden_layers") or text.get("n_layer") or 0)
    width = int(text.get("hidden_size") or text.get("n_embd") or 0)
    vocab = int(text.get("vocab_size") or 0)
    tied = bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    shapes: dict[str, list[int]] = {}
    try:
        for f in sorted(d.glob("*.safetensors")):
            shapes.update(_safetensors_shapes(f))
    except (OSError, ValueError, KeyError, struct.error):
        shapes = {}
    if shapes:
        n = sum(int(np.prod(s)) for s in shapes.values())
        emb = sum(
            int(np.prod(s))
            for k, s in shapes.items()
            if "embed_tokens" in k or k.endswith("wte.weight")
        )
    else:  # no weights here: estimate a Llama-style decoder from its shape
        inter = int(text.get("intermediate_size") or 4 * width)
        per_layer = 4 * width * width + 3 * width * inter
        emb = vocab * width
        n = layers * per_layer + emb * (1 if tied else 2)
    if tied:
        emb = 0  # the table is also the output projection, a matmul
    if not (layers and width):
        return None
    return ModelFacts(n_params=n, n_embedding=emb, n_layers=layers, d_model=width, vocab_size=vocab)


@dataclass
class DataFacts:
    stats: dict[str, Any]  # the manifest's "stats" section (may be partial)
    lengths: np.ndarray | None  # per-sequence lengths, when a store was read
    store: str | None

    @property
    def p99(self) -> int | None:
        v = (self.stats.get("document_length") or {}).get("p99")
        return int(v) if isinstance(v, (int, float)) and v > 0 else None

    def padding_to(self, max_len: int) -> dict[str, Any] | None:
        """The stats' padding-waste row for `max_len` (every row padded to max_len)."""
        for row in self.stats.get("padding_waste") or []:
            if isinstance(row, dict) and row.get("max_len") == max_len:
                return row
        if self.lengths is not None and len(self.lengths):
            return padding_waste(np.asarray(self.lengths, dtype=np.int64), max_len)
        return None


def data_facts_from_store(path: str | Path) -> DataFacts:
    """Stats and lengths of a token store directory (the manifest is read defensively)."""

    store = TokenStore(path)  # DataError with a clear message when it is not a store
    stats = store.manifest.get("stats")
    return DataFacts(
        stats=stats if isinstance(stats, dict) else {},
        lengths=np.asarray(store.lengths),
        store=str(path),
    )


def random_batch_padding(
    lengths: np.ndarray, rows: int, max_len: int | None, *, seed: int = 0
) -> float:
    """Padding fraction when random batches of `rows` are padded to their longest row.

    This is what HF's default collators do (dynamic padding), with rows truncated
    at `max_len`; the batches are drawn in one seeded shuffle, so it is repeatable.
    """
    a = np.asarray(lengths, dtype=np.int64)
    if max_len:
        a = np.minimum(a, max_len)
    if len(a) == 0 or rows < 1:
        return 0.0
    a = np.random.default_rng(seed).permutation(a)
    n = len(a) // rows * rows
    if n == 0:
        return 0.0
    b = a[:n].reshape(-1, rows)
    return float(1 - b.sum() / (b.max(axis=1).sum() * rows))
