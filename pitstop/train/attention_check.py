"""The start-up attention self-check of a run: train/packcheck.py's comparison, run on the
model with the kernel the run chose, with the fallback chain when that kernel cannot run,
and its verdict as the banner's choice (a leak refuses a run that packs documents)."""

from __future__ import annotations

from typing import Any

import torch

from pitstop.catalog.layouts import Layout
from pitstop.core import log
from pitstop.core.errors import PitstopError
from pitstop.probe import Choice
from pitstop.train import model_io, packcheck
from pitstop.train.doc_attention import KernelMismatch
from pitstop.train.forward import forward_kwargs, to_device


def check_kernel(
    model: Any,
    device: torch.device,
    attention: str,
    autocast_dtype: torch.dtype | None,
    precision: str,
) -> packcheck.PackCheck:
    """train/packcheck.py's comparison of the model as it computes now (with `attention`)
    against its eager attention, on one packed micro-batch."""
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 2)
    return packcheck.check_packed_attention(
        model,
        forward_kwargs=forward_kwargs,
        to_device=lambda mb, k: to_device(mb, device, k),
        device_type=device.type,
        autocast_dtype=autocast_dtype,
        precision=precision,
        attention=attention,
        vocab_size=vocab,
    )


def packed_attention_check(
    model: Any,
    device: torch.device,
    attention: str,
    autocast_dtype: torch.dtype | None,
    precision: str,
) -> tuple[packcheck.PackCheck, Choice | None]:
    """The start-up attention self-check (train/packcheck.py), and the attention choice to
    use instead when `attention` could not even run it (None: keep it).

    A kernel that raises on its first forward is an optimisation that does not apply here:
    flex_attention failing to compile on this GPU, a broken flash-attn build, or sdpa_docs
    (or sdpa) refusing an attention it does not compute (a logit softcap, attention sinks;
    doc_attention.KernelMismatch). The model switches to the next of sdpa, eager that runs
    (straight to eager after a KernelMismatch), with a warning naming the failure, and that
    kernel is checked instead. Eager is the model's own attention: if it cannot run,
    nothing can."""

    def check(kernel: str) -> packcheck.PackCheck:
        return check_kernel(model, device, kernel, autocast_dtype, precision)

    failures: list[str] = []
    chain = [attention] + [k for k in ("sdpa", "eager") if k != attention]
    while chain:
        kernel = chain.pop(0)
        if failures:
            model_io.set_attention(model, kernel)
        try:
            result = check(kernel)
        except Exception as e:
            if kernel == "eager" or isinstance(e, PitstopError):
                raise  # the model's own attention cannot run: nothing to fall back to
            failures.append(f"{kernel} failed on its first forward ({type(e).__name__}: {e})")
            if isinstance(e, KernelMismatch):
                # What sdpa_docs cannot compute (softcap, sinks) sdpa cannot either, and
                # some transformers releases let sdpa drop a softcap without a word.
                chain = ["eager"]
            continue
        if not failures:
            return result, None
        why = "; ".join(f[:300] for f in failures)
        log.warning(f"pitstop: warning: {why}; falling back to {kernel}")
        return result, Choice(kernel, f"{why}; {kernel} instead")
    raise AssertionError("unreachable: eager either returns or raises")


def packed_attention_choice(check: packcheck.PackCheck, batching: str, rank: int) -> Choice:
    """The self-check's verdict as a banner choice. A leak refuses a run that packs
    documents; a run without packed rows (bucket, pad) is not affected and goes on warned."""
    if check.ok:
        return Choice("checked", check.summary())
    layout = Layout.lookup(batching)  # None for a caller's own loader ("custom")
    if layout is not None and not layout.packed:
        if rank == 0:
            log.warning(
                f"pitstop: warning: {check.summary()}; --batching {batching} packs no "
                "documents together, so this run is not affected (--batching pack would be)"
            )
        return Choice("leaks (unused)", check.summary() + f"; not used by --batching {batching}")
    kernels = ["sdpa_docs", "sdpa", "eager", "flex_attention", "flash_attention_2"]
    raise packcheck.leak_error(check, batching=batching, attention_choices=kernels)
