"""`--compile on` that never crashes a run the eager path could train.

torch.compile compiles on the first forward; that can fail (an unsupported op, a backend
missing on this machine). `GuardedForward` then falls back, with a warning naming what
failed, to the module the run wraps for its strategy: the DDP/FSDP wrapper, never the bare
model (a bare model's gradients would never be all-reduced: ranks would silently train
apart, or hang when only some of them fell back).

Two failures are not compile failures:

- an out-of-memory error, even one raised while compiling, is re-raised unchanged: the
  trainer's OOM path (back off to a smaller micro-batch, or stop with what would fit)
  handles it, and compile stays on (it fits at the smaller size, or nothing does);
- the model's own error: the eager retry raises it again, and the run stops with it.

A later recompile (a new micro-batch shape) that fails falls back the same way.

Ranks agree: a rank that fell back cannot tell the others at once (a collective inside a
forward would pair with DDP's gradient all-reduce on the other ranks), so the trainer
ORs `failed` over ranks at its next logging step (`Trainer._agree`) and every rank then
falls back (`fall_back`). Until then the math is the same on every rank (compile does
not change it); only the speed differs.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pitstop.core import log
from pitstop.core.faults import NO_FAULTS, Faults
from pitstop.probe import Choice
from pitstop.train import oom

if TYPE_CHECKING:  # torch is imported where it is used, as before
    from pitstop.train.forward import DeviceBatch

__all__ = ["GuardedForward", "compile_module", "mark_rows_dynamic"]


class GuardedForward:
    """Calls `compiled` (torch.compile of `eager`) until it fails, then `eager` for good.

    `compiled=None`: compile is off; every call goes to `eager`.
    """

    def __init__(self, eager: Callable[..., Any], compiled: Callable[..., Any] | None) -> None:
        self.eager = eager
        self.compiled = compiled
        self.failure: str | None = None  # what failed, once it has (this rank)

    @property
    def active(self) -> bool:
        return self.compiled is not None

    @property
    def failed(self) -> bool:
        return self.failure is not None

    def __call__(self, **kwargs: Any) -> Any:
        if self.compiled is None:
            return self.eager(**kwargs)
        failed = False
        try:
            out = self.compiled(**kwargs)
        except Exception as e:
            if oom.is_oom(e):
                raise  # the trainer's OOM path backs off or stops; compile stays on
            self.fall_back(f"{type(e).__name__}: {e}")
            failed = True
        if failed:
            # Outside `except`: the traceback's frames held the failed attempt's tensors.
            gc.collect()
            _empty_cuda_cache()
            return self.eager(**kwargs)
        return out

    def to_eager(self, choices: dict[str, Any]) -> tuple[Callable[..., Any], bool]:
        """Every rank eager from now on (this one's compile failed, or another's did):
        records the compile choice and returns (the forward to call, compiled=False)."""
        self.fall_back("another rank's compile failed")
        why = self.failure or "failed"
        choices["compile"] = Choice(False, f"compile failed ({why[:120]}); eager")
        return self.eager, False

    def fall_back(self, why: str) -> None:
        """Use the eager (still wrapped) module from now on; warn once, naming `why`."""
        if self.compiled is None:
            return
        self.compiled = None
        self.failure = why
        log.warning(
            f"pitstop: warning: torch.compile failed ({_short(why)}); continuing without "
            "compile (the same model, wrapped the same way; the training math is unchanged)"
        )


def mark_rows_dynamic(batch: DeviceBatch) -> None:
    """Make a micro-batch's row count one size torch.compile never specialises on, so every
    row count, one row included, runs the first graph (eager calls ignore the mark).

    Dynamo compiles a size as a constant, recompiles once with it dynamic when a second
    value comes, and always compiles a size of 1 as a graph of its own (it specialises 0
    and 1). A step of 5 rows cut into micro-batches of 2 + 2 + 1 therefore cost a second
    compile: 21-27 s cold on the headline model on the 2-core CPU (bench/compile_payoff,
    2026-11-28). Marked unbacked (shared by the tensors whose first dimension is the rows),
    the count is a symbol with no 0/1 specialisation from the first graph on, and the
    model's code may not branch on it: transformers' Llama does not
    (tests/test_compile_sdpa_docs.py runs 1- and 2-row micro-batches in one graph). The
    same compiled step measured within noise of the static one (0.58 against 0.56 s and
    0.62 against 0.65 s, forward and backward of 2 rows of 1024, in one process)."""
    import torch

    for key in ("input_ids", "position_ids", "attention_mask"):
        t = batch.get(key)  # attention_mask: sdpa_docs' marker only
        if isinstance(t, torch.Tensor):
            torch._dynamo.decorators.mark_unbacked(t, 0, shape_id="micro_batch_rows")


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + " ..."


def _empty_cuda_cache() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def compile_module(wrapped: Any, rank: int, faults: Faults = NO_FAULTS) -> Callable[..., Any]:
    """torch.compile of the module the run wraps for its strategy (compiled lazily: the first
    forward compiles).

    The test fault COMPILE_FAILS_ON_RANK=R (pitstop/core/faults.py): no real compile; rank R's
    "compiled" forward raises as a failed compile does, the others' is the wrapped module.
    """
    if faults.compile_fails_on_rank is not None:
        if faults.compile_fails_on_rank != rank:
            return wrapped

        def failing(**kwargs: Any) -> Any:
            raise RuntimeError("COMPILE_FAILS_ON_RANK: compile failed (a test fault)")

        return failing
    import torch

    return torch.compile(wrapped)
