"""Facts the rules need about the model and the data, read cheaply and defensively.

Model: `config.json` for the shape (read by `pitstop.catalog.model_config.ModelConfig`
and priced by the cost model's `shape_from_config`, as `pitstop estimate` does), and
the safetensors headers for the exact parameter count (a header is a few KB of JSON at
the start of each file; no weights are read). Data: a token store's manifest "stats" (written by
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

from pitstop.catalog.model_config import ModelConfig
from pitstop.core.errors import DataError
from pitstop.data.stats import PaddingWaste, padding_waste
from pitstop.data.store import TokenStore
from pitstop.measure.cost_model import (
    FlopsModel,
    ModelShape,
    flops_for_shape,
    shape_from_config,
    shape_from_params,
)


@dataclass(frozen=True)
class ModelFacts:
    n_params: int  # every parameter
    n_embedding: int  # input-embedding parameters that are only a lookup (not tied to the output)
    n_layers: int
    d_model: int
    vocab_size: int
    max_positions: int | None = None  # config.json max_position_embeddings
    # The cost model's shape from config.json (None for a config it cannot read).
    shape: ModelShape | None = None

    @property
    def n_dense(self) -> int:
        """Parameters that cost matmul FLOPs (the cost model's N)."""
        return self.n_params - self.n_embedding

    def cost_shape(self) -> ModelShape:
        """The shape the cost model prices: config.json's, else a labelled Llama-shaped guess
        from the parameter count (the guess `pitstop estimate --params N` makes too)."""
        if self.shape is not None:
            return self.shape
        return shape_from_params(float(self.n_params), vocab=self.vocab_size or 32000)

    def flops(self, lora_r: int | None = None) -> FlopsModel:
        """The cost model's FLOPs counts of this model (all of it trains, or LoRA adapters).

        With a config.json shape these are the counts `pitstop estimate` uses, so the two
        commands print the same FLOPs; without one, the parameter count (a LoRA plan then
        prices a Llama-shaped guess of that size)."""
        if self.shape is None and lora_r is None:
            return FlopsModel(self.n_dense, 0, self.n_layers, self.d_model)
        return flops_for_shape(self.cost_shape(), lora_r)

    def flops_per_token(self, seq_len: int) -> float:
        """6·N + 12·L·d·T, the training FLOPs per token pitstop uses everywhere."""
        return self.flops().per_token(seq_len)


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
    cfg = ModelConfig.read_optional(d)
    if cfg is None:
        return None
    bad = cfg.size_problems()
    if bad:  # the doctor would judge a model that cannot be built: say what is wrong instead
        raise DataError(f"--model {d}: its config.json's {'; '.join(bad)}; fix config.json")
    layers = cfg.num_hidden_layers or 0
    width = cfg.hidden_size or 0
    vocab = cfg.vocab_size or 0
    tied = cfg.tie_word_embeddings
    shapes: dict[str, list[int]] = {}
    try:
        for f in sorted(d.glob("*.safetensors")):
            shapes.update(_safetensors_shapes(f))
    except (OSError, ValueError, KeyError, struct.error):
        shapes = {}
    try:
        shape: ModelShape | None = shape_from_config(cfg)
    except DataError:
        shape = None  # not a Llama-style config: the memory rules use the parameter count
    if shapes:
        n = sum(int(np.prod(s)) for s in shapes.values())
        emb = sum(
            int(np.prod(s))
            for k, s in shapes.items()
            if "embed_tokens" in k or k.endswith("wte.weight")
        )
    elif shape is not None:  # no weights here: the cost model counts them from the shape
        pc = shape.params()
        n, emb = pc.total, pc.embedding
    else:
        inter = cfg.intermediate_size or 4 * width
        per_layer = 4 * width * width + 3 * width * inter
        emb = vocab * width
        n = layers * per_layer + emb * (1 if tied else 2)
    if tied:
        emb = 0  # the table is also the output projection, a matmul
    if not (layers and width):
        return None
    return ModelFacts(
        shape=shape,
        n_params=n,
        n_embedding=emb,
        n_layers=layers,
        d_model=width,
        vocab_size=vocab,
        max_positions=cfg.max_position_embeddings,
    )


@dataclass
class DataFacts:
    stats: dict[str, Any]  # the manifest's "stats" section (may be partial)
    lengths: np.ndarray | None  # per-sequence lengths, when a store was read
    store: str | None
    # Per-document lengths (a store's sequences summed by document; a document longer than
    # the store's max length was split, so these are the lengths before any cut).
    doc_lengths: np.ndarray | None = None

    def truncated_share(self, max_len: int) -> float | None:
        """Share of the data's tokens beyond `max_len` in their document (lost to a cut)."""
        if self.doc_lengths is None or not len(self.doc_lengths):
            return None
        d = np.asarray(self.doc_lengths, dtype=np.int64)
        total = int(d.sum())
        return float(np.maximum(d - max_len, 0).sum() / total) if total else None

    @property
    def p99(self) -> int | None:
        v = (self.stats.get("document_length") or {}).get("p99")
        return int(v) if isinstance(v, (int, float)) and v > 0 else None

    def padding_to(self, max_len: int) -> PaddingWaste | None:
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
    lengths = np.asarray(store.lengths)
    docs = np.asarray(store.doc_ids)
    doc_lengths = (
        np.bincount(docs - docs.min(), weights=lengths).astype(np.int64) if len(docs) else None
    )
    return DataFacts(
        stats=stats if isinstance(stats, dict) else {},
        lengths=lengths,
        store=str(path),
        doc_lengths=doc_lengths[doc_lengths > 0] if doc_lengths is not None else None,
    )


def data_facts_from_lengths(lengths: list[int] | np.ndarray, *, source: str) -> DataFacts:
    """Facts from rows' token counts alone (e.g. a sample of a Trainer's dataset)."""
    from pitstop.data.stats import compute_stats

    a = np.asarray(lengths, dtype=np.int64)
    longest = int(a.max()) if len(a) else 1
    stats = compute_stats(a, a, max_seq_len=longest, counts={"documents": len(a), "sample": source})
    return DataFacts(stats=stats, lengths=a, store=None)


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
