"""How `sdpa_docs` computes on a CPU: a fused-kernel call per document, or each row as two
matrix products under its documents' mask. A measured choice, made once per machine and
shape.

`sdpa_docs` (train/doc_attention.py) runs each document's causal attention alone with
SDPA's fused CPU kernel (`_scaled_dot_product_flash_attention_for_cpu`). In bf16 that
kernel pays a large fixed cost per call and per block: on the AMD EPYC development machine
a forward and backward of 8 rows of 128 positions (4 heads of 64) took 5.2 ms as a call per
document and 1.6 ms as `doc_kernel.row_matmul_attention`, which computes every query-key
score of a row in one matrix product, masks what the documents rule out, and multiplies by
the values (transformers' eager attention, under the documents' mask). At rows of 512 the
rows were still 1.7x faster there; in fp32 the call per document was as fast or faster at
every length (`python -m bench.attention_rows`, bench/results/attention_rows.md); at 1,024
the two were even in bf16 (a whole run 1.00x, bench/results/attention_rows-1024.md). So
which one is faster depends on the row length, the precision and the CPU: it is timed, not
ruled.

The choice, `attention_rows` in the banner and summary:

- only for `sdpa_docs` on a CPU, in an eager run (a compiled one calls the per-document
  op, train/doc_op.py, which its compile measurements were taken with), and only for rows
  of at most `ROWS_MAX_LEN` positions: a row's T x T scores are kept for the backward
  (B x H x T^2 floats a layer), and at 1,024 the rows no longer gained;
- timed at the run's micro-batch (rows, heads, key/value heads, row length, head dim) in
  its autocast dtype, forward and backward, interleaved, the rows laid out as the run lays
  them out: packed with documents of the data's median length (`pack`), else one document
  a row. The per-document path's cost follows the layout (a call per document), the rows'
  does not. Rows are taken only at `ROWS_MIN_GAIN` times faster, so that steps of other
  layouts than the median's cannot turn the choice around;
- never where the rows' scores, kept for the backward, would take over a quarter of the
  host memory available (`ROWS_MEMORY_SHARE`);
- not timed in a run of several processes (each would time through the others' load,
  and ranks could decide apart), as for the CPU precision;
- timed only where the planned run repays the timing (~0.5 s; the rule of
  batching/payoff.py, as for every first-run measurement): a short run keeps the
  per-document call and says so;
- cached per machine, thread count, torch version and shape (`attention_rows-<digest>.json`
  in pitstop's cache, like the precision measurement), and kept by a resumed run
  (choices.json): the two paths add in another order, so a resume that switched would not
  be bit-identical.

Where rows are taken, `pitstop train` runs its start-up self-check again with them
(`checked_rows`); rows that do not give the model's eager attention are not used. Both
compute the same attention (each document's causal attention, within the layer's sliding
window), up to float rounding: tests/test_attention_families.py runs every family's model
both ways against its eager attention, tests/test_attention_rows.py the two paths against
each other in bf16.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import numpy as np
import torch

from pitstop.batching.payoff import payoff
from pitstop.batching.settings import BatchSettings
from pitstop.core.atomic import write_cache_entry
from pitstop.core.cache_layout import ATTENTION_ROWS, keyed_cache_path
from pitstop.measure.peak import cpu_measurement_key, read_cached
from pitstop.probe import Choice
from pitstop.train.attention_check import check_kernel
from pitstop.train.doc_attention import DOC_ATTENTION, ROWS_ATTR
from pitstop.train.doc_kernel import per_document_sdpa, row_matmul_attention

__all__ = [
    "ROWS_MAX_LEN",
    "ROWS_MIN_GAIN",
    "RowsRequest",
    "RowsSpeed",
    "apply_rows",
    "attention_shape",
    "checked_rows",
    "choose_rows",
    "cpu_rows_speed",
    "decide_rows",
    "measure_rows_speed",
    "packed_offsets",
    "ruled_rows",
    "scores_bytes",
    "typical_document",
]

ROWS_MAX_LEN = 512
ROWS_MIN_GAIN = 1.1
# What timing the two paths costs, at most (two paths, warm-up and repeats of ~_SAMPLE_S),
# and the smallest gain on the run it could act on: attention is about a third of a CPU step
# (bench/results/op_shares-bf16.md) and rows are taken at ROWS_MIN_GAIN.
TIMING_COST_S = 0.5
TIMING_GAIN = 0.03
# The row products keep each layer's scores for the backward: never more than this share of
# the host memory available at start-up.
ROWS_MEMORY_SHARE = 0.25
_SCORE_BYTES = 4 + 2 + 1  # fp32 softmax output, its bf16 copy, the bool mask
_REPEATS = 5
_SAMPLE_S = 0.03  # each timed sample lasts at least this long

# (rows, heads, key/value heads, row length, head dim) of a micro-batch's attention call
Shape = tuple[int, int, int, int, int]


class RowsSpeedRecord(TypedDict):
    """A RowsSpeed as the choice's measurement (summary.json, choices.json)."""

    documents_seconds: float
    rows_seconds: float
    rows_speedup: float
    shape: list[int]
    dtype: str
    document_length: int
    source: str


@dataclass(frozen=True)
class RowsSpeed:
    """A timing of `sdpa_docs`' two CPU paths at one shape: forward and backward seconds."""

    documents_s: float  # a call per document
    rows_s: float  # two matrix products a row
    shape: Shape
    dtype: str
    doc_len: int  # the rows were packed with documents this long (the row length: one a row)
    source: str  # measured, or reused from the cache

    @property
    def gain(self) -> float:
        return self.documents_s / self.rows_s if self.rows_s > 0 else 0.0

    def describe(self) -> str:
        b, h, h_kv, t, d = self.shape
        heads = f"{h} heads" + (f" ({h_kv} key/value)" if h_kv != h else "")
        docs = "one document a row" if self.doc_len >= t else f"documents of {self.doc_len}"
        return (
            f"{self.source}: attention forward+backward of {b} rows x {t} positions ({docs}), "
            f"{heads} of {d}, {self.dtype}: {self.documents_s * 1e3:.2f} ms a call per document, "
            f"{self.rows_s * 1e3:.2f} ms as matrix products a row ({self.gain:.2f}x)"
        )

    def to_dict(self) -> RowsSpeedRecord:
        return RowsSpeedRecord(
            documents_seconds=self.documents_s,
            rows_seconds=self.rows_s,
            rows_speedup=round(self.gain, 4),
            shape=list(self.shape),
            dtype=self.dtype,
            document_length=self.doc_len,
            source=self.source,
        )


def attention_shape(model: Any, rows: int, length: int) -> Shape | None:
    """The attention call's shape for micro-batches of `rows` rows of `length` positions,
    from the model's config; None when the config does not say (heads, width)."""
    config = getattr(model, "config", None)
    config = getattr(config, "get_text_config", lambda: config)() if config is not None else None
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    if not heads or not hidden:
        return None
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return (max(1, rows), int(heads), int(kv), int(length), int(head_dim))


def packed_offsets(rows: int, length: int, doc_len: int) -> torch.Tensor:
    """Document offsets of `rows` rows of `length` positions packed with documents of
    `doc_len` positions (the last one of each row shorter): int32 [n_docs + 1]."""
    doc_len = max(1, min(doc_len, length))
    starts = {r * length + s for r in range(rows) for s in range(0, length, doc_len)}
    return torch.tensor(sorted(starts | {rows * length}), dtype=torch.int32)


def measure_rows_speed(shape: Shape, dtype: torch.dtype, doc_len: int) -> tuple[float, float]:
    """(per-document seconds, row-products seconds): the fastest of a few forward+backward
    passes of each path at `shape` in `dtype`, rows packed with documents of `doc_len`
    positions, interleaved so a busy moment hits both."""
    b, h, h_kv, t, d = shape
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, t, d, generator=g).to(dtype)
    k, v = (torch.randn(b, h_kv, t, d, generator=g).to(dtype) for _ in range(2))
    cu = packed_offsets(b, t, doc_len)

    def passes(path: Any, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
            path(qq, kk, vv, cu).float().sum().backward()
        return (time.perf_counter() - t0) / n

    paths = (per_document_sdpa, row_matmul_attention)
    for path in paths:
        passes(path, 1)  # warm-up: the thread pool, each kernel's first dispatch
    n = max(1, min(200, math.ceil(_SAMPLE_S / max(passes(paths[0], 1), 1e-6))))
    best = [float("inf")] * len(paths)
    for _ in range(_REPEATS):
        for i, path in enumerate(paths):
            best[i] = min(best[i], passes(path, n))
    return best[0], best[1]


def cpu_rows_speed(
    cache_dir: str | Path | None,
    shape: Shape,
    dtype: torch.dtype,
    doc_len: int,
    *,
    measure: bool = True,
) -> RowsSpeed | None:
    """The two paths timed at `shape` in `dtype`, rows packed with documents of `doc_len`
    positions, on this CPU: from the cache, else timed (and cached) where `measure`, else
    None."""
    name = str(dtype).removeprefix("torch.")
    doc_len = max(1, min(doc_len, shape[3]))
    key = {**cpu_measurement_key(), "shape": list(shape), "dtype": name, "doc_len": doc_len}
    path = keyed_cache_path(cache_dir, ATTENTION_ROWS, key)
    rec = read_cached(path, key)
    if rec is not None:
        try:
            docs_s, rows_s = float(rec["documents_s"]), float(rec["rows_s"])
            return RowsSpeed(docs_s, rows_s, shape, name, doc_len, f"reused (cached in {path})")
        except (KeyError, TypeError, ValueError):
            pass
    if not measure:
        return None
    docs_s, rows_s = measure_rows_speed(shape, dtype, doc_len)
    if path is not None:
        write_cache_entry(path, json.dumps({"key": key, "documents_s": docs_s, "rows_s": rows_s}))
    return RowsSpeed(docs_s, rows_s, shape, name, doc_len, "measured on this CPU")


def ruled_rows(*, device_type: str, attention: str, compiled: bool, length: int) -> Choice | None:
    """The choice where nothing needs timing (always the per-document call); None where the
    two paths must be timed."""
    if attention != DOC_ATTENTION:
        return Choice(False, f"the kernel is {attention}, not {DOC_ATTENTION}")
    if device_type != "cpu":
        return Choice(False, "a GPU: fused kernels per document (or grouped)")
    if compiled:
        return Choice(False, "compiled: the per-document op, as compile's gain was measured with")
    if length > ROWS_MAX_LEN:
        return Choice(
            False,
            f"rows of {length} positions: over {ROWS_MAX_LEN}, the T x T scores a row cost more "
            "than a call per document (not timed)",
        )
    return None


def choose_rows(measured: RowsSpeed) -> Choice:
    """Whether `sdpa_docs` computes each row as matrix products (True) or calls its fused
    kernel per document (False), from the two paths' timing, and why."""
    if measured.gain >= ROWS_MIN_GAIN:
        return Choice(
            True,
            f"each row as two matrix products under its documents' mask, measured faster: "
            f"{measured.describe()}",
            measured.to_dict(),
        )
    return Choice(
        False,
        f"a call per document: matrix products a row were not {ROWS_MIN_GAIN:.2f}x faster: "
        f"{measured.describe()}",
        measured.to_dict(),
    )


@dataclass(frozen=True)
class RowsRequest:
    """What the choice depends on, from the run being built."""

    device_type: str
    attention: str
    compiled: bool
    shape: Shape | None  # the micro-batch's attention call; None: the config does not say
    dtype: torch.dtype  # the autocast dtype, else the weights'
    doc_len: int  # the documents' median length within a row (the row length: one a row)
    run_s: float | None  # the planned run's estimated seconds (None: no estimate)
    layers: int = 1  # attention layers, each keeping its scores for the backward
    available_bytes: int | None = None  # host memory available (None: not known)
    processes: int = 1  # training processes on this machine (torchrun, --nproc)


def decide_rows(req: RowsRequest, cache_dir: str | Path | None) -> Choice:
    """The choice for a run: by rule where nothing needs timing, else from the cache, else
    timed where the planned run repays the timing (batching/payoff.py's rule), else the
    per-document call, with the reason."""
    ruled = ruled_rows(
        device_type=req.device_type,
        attention=req.attention,
        compiled=req.compiled,
        length=req.shape[3] if req.shape is not None else 0,
    )
    if ruled is not None:
        return ruled
    if req.shape is None:
        return Choice(False, "a call per document (not timed: the model's heads are unknown)")
    if req.processes > 1:
        # As for the CPU precision: processes timing side by side on one CPU read each
        # other's load, and ranks that decided apart would round apart.
        return Choice(
            False,
            f"a call per document (not timed: {req.processes} processes share this CPU, and "
            "each would time the paths through the others' load)",
        )
    kept, free = scores_bytes(req.shape, req.layers), req.available_bytes
    if free is not None and kept > ROWS_MEMORY_SHARE * free:
        return Choice(
            False,
            f"a call per document: as matrix products the rows would keep {kept / 2**30:.1f} GiB "
            f"of scores for the backward ({req.layers} layers), over {ROWS_MEMORY_SHARE:.0%} of "
            f"the {free / 2**30:.1f} GiB of memory available (not timed)",
        )
    weighed = payoff(TIMING_COST_S, req.run_s or 0.0, TIMING_GAIN)
    measured = cpu_rows_speed(cache_dir, req.shape, req.dtype, req.doc_len, measure=weighed.worth)
    if measured is None:
        # Recorded with the payoff's numbers like a measured choice: a resumed run keeps it,
        # even once a longer run has cached a timing that would decide otherwise.
        why = "not timed: " + weighed.describe("timing the two paths")
        return Choice(False, f"a call per document ({why})", {"timing": weighed.to_dict()})
    return choose_rows(measured)


def scores_bytes(shape: Shape, layers: int) -> int:
    """Bytes the row products keep for the backward across `layers`: each layer's T x T
    scores as fp32 softmax output and its low-precision copy, and the mask (a bound: the
    mask and the copy are smaller in fp32 runs)."""
    b, h, _, t, _ = shape
    return b * h * t * t * _SCORE_BYTES * max(1, layers)


def apply_rows(model: torch.nn.Module, rows: bool) -> None:
    """Mark every module of `model` so its `sdpa_docs` calls take the chosen path (the
    attention function reads the mark off the layer that calls it)."""
    for module in model.modules():
        setattr(module, ROWS_ATTR, bool(rows))


def checked_rows(
    model: torch.nn.Module,
    device: torch.device,
    autocast_dtype: torch.dtype | None,
    precision: str,
    choice: Choice,
) -> Choice:
    """`choice` (rows taken, and applied to `model`) after the start-up self-check has run
    again with the rows (the per-document call was checked when the model loaded): rows
    that do not give the model's eager attention, or fail, are taken off again and the
    choice says why."""
    try:
        check = check_kernel(model, device, DOC_ATTENTION, autocast_dtype, precision)
        problem = None if check.ok else check.summary()
    except Exception as e:  # an optimisation that cannot run here: the checked path stays
        problem = f"{type(e).__name__}: {e}"
    if problem is None:
        return choice
    apply_rows(model, False)
    return Choice(
        False, f"a call per document: the rows failed the start-up self-check ({problem})"
    )


def typical_document(settings: BatchSettings | None, length: int, lengths: Any | None) -> int:
    """The documents' median length within a row where rows are packed, else the row length
    (bucket and pad: one document a row)."""
    if settings is None or not settings.strategy.packed or lengths is None or not len(lengths):
        return length
    return int(min(length, max(1, int(np.median(np.minimum(lengths, length))))))
