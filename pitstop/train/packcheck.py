"""The packed-attention self-check: before step 1, packed documents must not see each other.

pitstop passes no attention mask; which kernel keeps a packed row's documents apart, and
how, depends on the transformers and torch versions and on the device (train/attention.py,
pitstop/versions.py). A version the static check does not know, a kernel patched by a
plug-in, or a device-specific path can still let them attend to each other: the loss
falls, nothing flags it. So every run checks, on its own device and versions, with the
kernel it trains with and the call the trainer makes (`to_device` for the kernel's extra
kwargs, `forward_kwargs`, the run's autocast):

    one packed micro-batch of 2 rows x 16 positions holding 5 documents (position ids
    restarting at 0 at each) gives, for every document, the logits of that document
    run alone (B=1, positions 0..n-1), up to `tolerance(precision)`.

It is six forwards of at most 32 tokens without gradients, in eval mode (no dropout):
milliseconds next to loading the model, so it runs always instead of being cached.
A mismatch stops the run (`PackedAttentionLeak`) with the ways out, unless the run has
no packed rows (bucket/pad: one document per row), where it only warns.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pitstop.errors import ConfigError

__all__ = ["PackCheck", "PackedAttentionLeak", "check_packed_attention", "packed_probe"]

# Two rows of 16 positions, full (no padding): [6, 10] and [3, 8, 5]. Several documents
# per row and more than one row: flash-attn's varlen path and the mask's per-row
# detection both get exercised, and every document but the first of a row can leak.
ROWS = ((6, 10), (3, 8, 5))

# Largest |packed - alone| over a document's logits, relative to the largest |alone| logit.
# fp32 kernels differ only in summation order (~1e-6); bf16/fp16 round every matmul to an
# 8/11-bit mantissa, and a deep model's logits move by a few 1e-3 of their scale between
# a B=2 and a B=1 call. A leak shifts later documents' logits by a large fraction of it
# (tests/test_packcheck.py measures it on the tiny Llama: tens of percent).
TOLERANCE = {"fp32": 1e-3, "bf16": 5e-2, "fp16": 2e-2}


class PackedAttentionLeak(ConfigError):
    """Packed documents attend to each other with this kernel, device and versions."""


@dataclass(frozen=True)
class PackCheck:
    ok: bool
    worst: float  # the largest relative difference over the documents
    tolerance: float
    worst_doc: int  # index of that document (row-major)
    seconds: float
    attention: str

    def summary(self) -> str:
        n = sum(len(r) for r in ROWS)
        verdict = "equal" if self.ok else "DIFFER from"
        return (
            f"{self.attention}: one packed micro-batch ({len(ROWS)} rows, {n} documents) gives "
            f"logits {verdict} each document run alone (largest relative difference "
            f"{self.worst:.1e}, tolerance {self.tolerance:.0e}; {self.seconds:.2f} s)"
        )


def packed_probe(vocab_size: int, *, seed: int = 0) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the packed micro-batch, each document alone) as host tensors, loader-shaped
    (input_ids, labels, position_ids; [B, T] int64)."""
    g = torch.Generator().manual_seed(seed)
    hi = max(2, min(int(vocab_size), 32000))
    width = sum(ROWS[0])
    ids, pos, alone = [], [], []
    for row in ROWS:
        assert sum(row) == width
        row_ids, row_pos = [], []
        for n in row:
            doc = torch.randint(1, hi, (n,), generator=g)
            row_ids.append(doc)
            row_pos.append(torch.arange(n))
            alone.append(_mb(doc[None], torch.arange(n)[None]))
        ids.append(torch.cat(row_ids))
        pos.append(torch.cat(row_pos))
    return _mb(torch.stack(ids), torch.stack(pos)), alone


def _mb(ids: torch.Tensor, pos: torch.Tensor) -> dict[str, Any]:
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": pos}


def check_packed_attention(
    model: torch.nn.Module,
    *,
    forward_kwargs: Callable[[dict[str, Any]], dict[str, Any]],
    to_device: Callable[[dict[str, Any]], dict[str, Any]],
    device_type: str,
    autocast_dtype: torch.dtype | None,
    precision: str,
    attention: str,
    vocab_size: int,
) -> PackCheck:
    """Run the check (see the module docstring); returns the verdict, raises nothing.

    `to_device(mb)`: the trainer's host-to-device step (adds the kernel's kwargs);
    `forward_kwargs(batch)`: what the trainer passes to the model's forward.
    """
    t0 = time.perf_counter()
    packed, alone = packed_probe(vocab_size)
    was_training = model.training
    model.eval()  # dropout would make the two calls differ
    _keep_4bit_layout(model)
    try:
        with torch.no_grad():
            full = _logits(model, forward_kwargs(to_device(packed)), device_type, autocast_dtype)
            docs = [
                _logits(model, forward_kwargs(to_device(a)), device_type, autocast_dtype)[0]
                for a in alone
            ]
    finally:
        model.train(was_training)
    worst, worst_doc, k = 0.0, 0, 0
    for b, row in enumerate(ROWS):
        col = 0
        for n in row:
            ref = docs[k]
            diff = (full[b, col : col + n] - ref).abs().max()
            scale = ref.abs().max().clamp_min(1e-6)
            rel = float(diff / scale)  # start-up, once: a sync is fine here
            if not rel <= worst:  # NaN counts as the worst
                worst, worst_doc = rel if rel == rel else float("inf"), k
            col += n
            k += 1
    tol = TOLERANCE.get(precision, TOLERANCE["bf16"])
    return PackCheck(worst <= tol, worst, tol, worst_doc, time.perf_counter() - t0, attention)


def _logits(
    model: Any, kwargs: dict[str, Any], device_type: str, autocast_dtype: torch.dtype | None
) -> torch.Tensor:
    with torch.autocast(
        device_type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None
    ):
        return model(**kwargs).logits.float()


def leak_error(
    check: PackCheck, *, batching: str, attention_choices: list[str]
) -> PackedAttentionLeak:
    """The refusal of a failed check, with the ways out."""
    others = [a for a in attention_choices if a != check.attention]
    ways = []
    if others:
        ways.append("another kernel: " + " or ".join(f"--attention {a}" for a in others))
    ways.append("--batching bucket (one document per row: nothing to keep apart)")
    ways.append("an upgrade: pip install -U torch transformers (docs/versions.md)")
    return PackedAttentionLeak(
        f"packed documents attend to each other here: {check.summary()}. Training on "
        f"--batching {batching} would let each document see the ones packed before it. "
        "Ways out: " + "; ".join(ways)
    )


def _keep_4bit_layout(model: Any) -> None:
    """Leave bitsandbytes' 4-bit layers in training mode during the check.

    On a CPU with avx512_bf16, a 4-bit layer's first forward in eval mode without
    gradients repacks its weights in place into a CPU inference layout, and saving a
    checkpoint packs them back: numerics after the check (and across a resume) would
    differ from a run without it (tests/test_train_bnb.py caught a resume that was no
    longer bit-identical). These layers have no dropout, so training mode changes nothing
    else in the check."""
    for m in model.modules():
        if type(m).__name__ in ("Linear4bit", "LinearNF4", "LinearFP4"):
            m.training = True
