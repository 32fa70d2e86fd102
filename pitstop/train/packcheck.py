"""The start-up attention self-check: before step 1, the kernel a run trains with must
compute the model's own attention on packed documents.

pitstop passes no attention mask; which kernel keeps a packed row's documents apart, and
how, depends on the transformers and torch versions, the device and the model (a sliding
window, a logit softcap, attention sinks; train/attention.py, train/doc_attention.py,
pitstop/core/versions.py). A version the static check does not know, a kernel patched by a
plug-in, a device-specific path, or a kernel that drops what a layer asks of it can
train a different attention than the model is served with: the loss falls, nothing flags
it. So every run checks, on its own device, versions and model, with the kernel it trains
with and the call the trainer makes (`to_device` for the kernel's extra kwargs,
`forward_kwargs`, the run's autocast):

    one packed micro-batch of 2 rows x 24 positions holding 5 documents (position ids
    restarting at 0 at each) gives, for every document, the logits of the model's EAGER
    attention on that document alone (B=1, positions 0..n-1), within a tolerance
    calibrated on this model.

For `sdpa_docs` the packed forward runs twice, as an eager run calls the kernel and as a
compiled graph does (one opaque op, train/doc_op.py: `doc_attention.through_op`), and the
worse of the two is the verdict: a run that compiles is checked without compiling.

The reference is the model's eager attention, never the kernel under test. Every layer
type runs: a model with sliding windows longer than the probe's documents has its windows
shrunk to `CHECK_WINDOW` tokens for the check (kernel and reference alike, then restored),
so every document but one is longer than its window and a kernel that ignores windows
cannot pass.

The tolerance is calibrated on the user's own model and precision, with eager forwards:
- the noise: eager on the packed rows against eager on each document alone, which differ
  only in rounding (batch shape, summation order; large in bf16, TF32 or a deep model);
- a planted leak: eager on the packed rows with documents that see each other (a padding
  mask of ones turns off the document detection), and, for a windowed model, with its
  windows opened; the smaller of the two is the subtlest error the check must catch.
The tolerance is their geometric mean: as far, in ratio, from the model's rounding as from
a leak. Where the two are within `MIN_SEPARATION` of each other the check cannot tell
them apart on this model, and the fixed `TOLERANCE` of the precision is used (and said).

It is about ten forwards of at most 48 tokens without gradients, in eval mode (no
dropout): milliseconds next to loading the model, so it runs always instead of being
cached. A mismatch stops the run (`PackedAttentionLeak`) with the ways out and the
numbers, unless the run has no packed rows (bucket/pad: one document per row), where it
only warns.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from pitstop.batching.records import MicroBatch
from pitstop.core.errors import ConfigError
from pitstop.train.doc_attention import DOC_ATTENTION, through_op
from pitstop.train.forward import DeviceBatch

__all__ = [
    "PackCheck",
    "PackedAttentionLeak",
    "check_packed_attention",
    "model_windows",
    "packed_probe",
]

# Two rows of 24 positions, full (no padding): [7, 17] and [3, 12, 9]. Several documents
# per row and more than one row: flash-attn's varlen path and the mask's per-row
# detection both get exercised, every document but the first of a row can leak, and all
# but the 3-token one are longer than CHECK_WINDOW.
ROWS = ((7, 17), (3, 12, 9))
# A model's sliding windows, when longer than the probe's documents, are this long during
# the check: the window logic is what is checked, on every layer that has one.
CHECK_WINDOW = 5

# The fallback tolerance, where the calibration cannot separate noise from a leak: the
# largest |packed - reference| over a document's logits relative to its largest |logit|.
TOLERANCE = {"fp32": 1e-3, "bf16": 5e-2, "fp16": 2e-2}
# The smallest noise the calibration assumes: a model whose packed and alone forwards are
# bit-equal (fp32 on a CPU) still has a kernel that sums in another order.
NOISE_FLOOR = {"fp32": 1e-6, "bf16": 1e-3, "fp16": 1e-4}
# A planted leak must be this many times the noise for the calibration to be used.
MIN_SEPARATION = 16.0


class PackedAttentionLeak(ConfigError):
    """The kernel does not compute the model's attention on packed documents here."""


@dataclass(frozen=True)
class PackCheck:
    ok: bool
    worst: float  # the largest relative difference over the documents
    tolerance: float
    worst_doc: int  # index of that document (row-major)
    seconds: float
    attention: str
    noise: float = 0.0  # eager packed vs eager alone: this model's rounding
    leak: float = math.inf  # the subtlest planted leak (eager)
    window: str = ""  # how windows were checked ("" without windows)

    @property
    def calibrated(self) -> bool:
        """Whether the tolerance came from this model's noise and planted leak."""
        return self.leak > MIN_SEPARATION * self.noise

    def summary(self) -> str:
        n = sum(len(r) for r in ROWS)
        verdict = "equal to" if self.ok else "DIFFER from"
        if self.calibrated:
            tol = (
                f"tolerance {self.tolerance:.1e}, between this model's rounding "
                f"{self.noise:.1e} and a planted leak {self.leak:.1e}"
            )
        else:
            tol = (
                f"tolerance {self.tolerance:.0e}, the precision's fixed one: a planted leak "
                f"({self.leak:.1e}) is too close to this model's rounding ({self.noise:.1e}) "
                "to calibrate"
            )
        win = f"; {self.window}" if self.window else ""
        return (
            f"{self.attention}: one packed micro-batch ({len(ROWS)} rows, {n} documents) gives "
            f"logits {verdict} the model's eager attention on each document alone (largest "
            f"relative difference {self.worst:.1e}, document {self.worst_doc}; {tol}{win}; "
            f"{self.seconds:.2f} s)"
        )


def packed_probe(vocab_size: int, *, seed: int = 0) -> tuple[MicroBatch, list[MicroBatch]]:
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


def _mb(ids: torch.Tensor, pos: torch.Tensor) -> MicroBatch:
    return MicroBatch(input_ids=ids, labels=ids.clone(), position_ids=pos)


def model_windows(model: torch.nn.Module) -> list[int]:
    """The sliding windows the model's layers use (config and attention layers), sorted."""
    return sorted({w for obj in _window_holders(model) if (w := _window(obj)) is not None})


def _window(obj: Any) -> int | None:
    """`obj.sliding_window` when it is one (an int; None and flags are not)."""
    w = getattr(obj, "sliding_window", None)
    return w if isinstance(w, int) and not isinstance(w, bool) else None


def _window_holders(model: torch.nn.Module) -> list[Any]:
    """Every object a layer reads its window from: the configs (Mistral, Phi-3 read
    ``config.sliding_window`` per forward; masks are built from it) and the attention
    modules that keep their own (Gemma 2/3, Qwen2: set per layer type)."""
    holders: dict[int, Any] = {}
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "sliding_window"):
            holders[id(cfg)] = cfg
            sub = getattr(cfg, "text_config", None)
            if sub is not None and hasattr(sub, "sliding_window"):
                holders[id(sub)] = sub
        if "sliding_window" in vars(m):
            holders[id(m)] = m
    return list(holders.values())


@contextlib.contextmanager
def _windows_set(model: torch.nn.Module, size: int | None) -> Iterator[None]:
    """Every sliding window of the model set to `size` (None: left as it is), restored after."""
    saved = []
    if size is not None:
        for obj in _window_holders(model):
            if (w := _window(obj)) is not None:
                saved.append((obj, w))
                obj.sliding_window = size
    try:
        yield
    finally:
        for obj, w in saved:
            obj.sliding_window = w


@contextlib.contextmanager
def _attention_set(model: torch.nn.Module, kernel: str, current: str) -> Iterator[None]:
    if kernel == current:
        yield
        return
    from pitstop.train.model_io import set_attention

    set_attention(model, kernel)
    try:
        yield
    finally:
        set_attention(model, current)


def check_packed_attention(
    model: torch.nn.Module,
    *,
    forward_kwargs: Callable[[DeviceBatch], dict[str, Any]],
    to_device: Callable[[MicroBatch, str], DeviceBatch],
    device_type: str,
    autocast_dtype: torch.dtype | None,
    precision: str,
    attention: str,
    vocab_size: int,
) -> PackCheck:
    """Run the check (see the module docstring); returns the verdict. An exception of the
    kernel's own forward (it cannot run, or refuses an attention it does not compute)
    propagates: the caller switches kernel.

    `to_device(mb, kernel)`: the trainer's host-to-device step for `kernel` (adds its
    kwargs); `forward_kwargs(batch)`: what the trainer passes to the model's forward.
    """
    t0 = time.perf_counter()
    packed, alone = packed_probe(vocab_size)
    longest = max(max(r) for r in ROWS)
    windows = model_windows(model)
    # Any window as long as the probe's documents would leave its layers unchecked.
    shrink = CHECK_WINDOW if windows and max(windows) >= longest else None
    was_training = model.training
    model.eval()  # dropout would make the calls differ
    _keep_4bit_layout(model)

    def logits(mb: MicroBatch, kernel: str, **extra: Any) -> torch.Tensor:
        kwargs = forward_kwargs(to_device(mb, kernel))
        kwargs.update(extra)
        return _logits(model, kwargs, device_type, autocast_dtype)

    try:
        with torch.no_grad(), _windows_set(model, shrink):
            full = logits(packed, attention)
            if attention == DOC_ATTENTION:  # and as a compiled graph calls it (one op)
                with through_op():
                    through = logits(packed, attention)
            with _attention_set(model, "eager", attention):
                ref = [logits(a, "eager")[0] for a in alone]
                eager_packed = logits(packed, "eager")
                ones = torch.ones_like(packed["input_ids"]).to(full.device)
                leaks = [logits(packed, "eager", attention_mask=ones)]
                if windows:
                    with _windows_set(model, 1 << 30):
                        leaks.append(logits(packed, "eager"))
    finally:
        model.train(was_training)
    worst, worst_doc = _worst(full, ref)
    if attention == DOC_ATTENTION:
        worst, worst_doc = max((worst, worst_doc), _worst(through, ref))
    noise = max(_worst(eager_packed, ref)[0], NOISE_FLOOR.get(precision, NOISE_FLOOR["bf16"]))
    leak = min(_worst(x, ref)[0] for x in leaks)
    if leak > MIN_SEPARATION * noise:
        tol = math.sqrt(noise * leak)
    else:
        tol = TOLERANCE.get(precision, TOLERANCE["bf16"])
    window = ""
    if windows:
        shown = ", ".join(str(w) for w in windows)
        window = (
            f"sliding windows {shown} shrunk to {shrink} for the check, so its documents are "
            "longer than their window"
            if shrink
            else f"sliding windows {shown}, shorter than the longest document"
        )
    seconds = time.perf_counter() - t0
    return PackCheck(worst <= tol, worst, tol, worst_doc, seconds, attention, noise, leak, window)


def _worst(full: torch.Tensor, ref: list[torch.Tensor]) -> tuple[float, int]:
    """(the largest relative difference over the documents, that document's index)."""
    worst, worst_doc, k = 0.0, 0, 0
    for b, row in enumerate(ROWS):
        col = 0
        for n in row:
            diff = (full[b, col : col + n] - ref[k]).abs().max()
            scale = ref[k].abs().max().clamp_min(1e-6)
            rel = float(diff / scale)  # start-up, once: a sync is fine here
            if not rel <= worst:  # NaN counts as the worst
                worst, worst_doc = rel if rel == rel else float("inf"), k
            col += n
            k += 1
    return worst, worst_doc


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
        f"this attention kernel does not compute the model's own attention on packed "
        f"documents: {check.summary()}. Training on --batching {batching} would train a "
        "different attention than the model is served with. Ways out: " + "; ".join(ways)
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
