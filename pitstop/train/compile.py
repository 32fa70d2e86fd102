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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from pitstop.core import log
from pitstop.core.faults import NO_FAULTS, Faults
from pitstop.probe import Choice
from pitstop.train import oom

if TYPE_CHECKING:  # torch is imported where it is used, as before
    from pitstop.train.forward import DeviceBatch

__all__ = ["Blocks", "GuardedForward", "compile_module", "mark_rows_dynamic"]


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


def mark_rows_dynamic(batch: DeviceBatch, *, width: bool = False) -> None:
    """Make a micro-batch's row count one size torch.compile never specialises on, so every
    row count, one row included, runs the first graph; with `width` (bucket: rows as wide
    as each micro-batch's longest) the width is a dynamic size from the first graph on,
    not a recompile. The whole-model compile marks its inputs with it (`compile_module`).

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
            if width and key != "attention_mask":
                torch._dynamo.maybe_mark_dynamic(t, 1)


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + " ..."


def _empty_cuda_cache() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def compile_module(
    wrapped: Any,
    model: Any,
    rank: int,
    faults: Faults = NO_FAULTS,
    *,
    dynamic_width: bool = False,
    backend: str = "inductor",
) -> Callable[..., Any]:
    """What a compiled run's forward calls (compiled lazily: the first forward compiles).

    The model's repeated blocks (its `_no_split_modules`: the decoder layers) are compiled,
    one code for all of them (`Blocks`), and the rest of the forward runs eager. A model
    without such blocks is compiled whole (torch.compile of `wrapped`), and so is a run
    whose rows' width varies (`dynamic_width`, bucket): in a block, an unbacked row count
    times a dynamic width is a size transformers' sdpa reshapes with -1, which dynamo
    cannot decide (a graph break in every layer); whole, it compiles without one. Either
    way the forward marks what it compiles (`mark_rows_dynamic`, `Blocks`): one graph for
    every row count. `backend`: torch.compile's (tests trace with aot_eager).

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

    blocks = None if dynamic_width else Blocks.of(model, backend=backend)
    if blocks is None:
        whole = torch.compile(wrapped, backend=backend)

        def forward(**kwargs: Any) -> Any:
            mark_rows_dynamic(kwargs, width=dynamic_width)  # type: ignore[arg-type]
            return whole(**kwargs)

        return forward

    def forward_blocks(**kwargs: Any) -> Any:
        with blocks.compiled():
            return wrapped(**kwargs)

    return forward_blocks


class Blocks:
    """A model's repeated blocks compiled: one compiled code for every block of a class.

    Why blocks and not the whole model: the decoder layers are the same code with other
    weights, so dynamo traces one and inductor compiles it once, where a whole-model graph
    is every layer traced and compiled again. On the headline model (4 layers of 256, rows
    of 2 x 1024, the 2-core CPU, a cold cache) the first forward and backward took 24-26 s
    against 42 s compiled whole (4 s warm), and the compiled steps ran as fast (one
    process, interleaved: 1.07x eager against 1.08x for a per-layer `layer.compile()`).
    What stays eager is the embedding, the rotary tables, the final norm and the loss.

    Each block's `forward` is replaced by a dispatcher: inside `compiled()` it calls the
    compiled code, outside it the block's own forward, so the eager fallback
    (`GuardedForward`) is the same module with nothing compiled. The hooks a strategy puts
    on a block (FSDP2's all-gather) stay outside the compiled code, in eager.

    The row count of a block's inputs (its activations, the rotary tables, sdpa_docs'
    marker) is marked unbacked, as `mark_rows_dynamic` marks a whole model's: one graph for
    every row count, one row included. Rows of one width only (see `compile_module`).
    """

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.on = False
        self._code: dict[Any, Callable[..., Any]] = {}  # a block class's forward -> compiled

    @classmethod
    def of(cls, model: Any, *, backend: str = "inductor") -> Blocks | None:
        """The model's blocks dispatched to compiled code, or None when it names none
        (`backend`: torch.compile's; the CPU's self-test traces with aot_eager)."""
        names = set(getattr(model, "_no_split_modules", None) or [])
        # By the class's ancestry: FSDP2 renames a block's class (FSDPLlamaDecoderLayer).
        found = [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]
        if not found:
            return None
        blocks = cls(backend)
        for block in found:
            blocks._dispatch(block)
        return blocks

    def _dispatch(self, block: Any) -> None:
        import torch

        fn = type(block).forward
        code = self._code.get(fn)
        if code is None:
            code = self._code[fn] = torch.compile(fn, backend=self.backend)
        eager = block.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return eager(*args, **kwargs)
            self._mark([*args, *kwargs.values()])  # hidden_states first
            return code(block, *args, **kwargs)

        block.forward = forward

    @contextmanager
    def compiled(self) -> Iterator[None]:
        """Inside: the blocks call their compiled code (off again on the way out, errors too)."""
        self.on = True
        try:
            yield
        finally:
            self.on = False

    def _mark(self, values: list[Any]) -> None:
        import torch

        first = values[0] if values else None
        if not isinstance(first, torch.Tensor) or first.dim() < 2:
            return
        rows = first.shape[0]
        values = values + [t for v in values if isinstance(v, tuple) for t in v]  # rotary tables
        for t in values:
            if not isinstance(t, torch.Tensor) or t.dim() < 2 or t.shape[0] != rows:
                continue
            torch._dynamo.decorators.mark_unbacked(t, 0, shape_id="micro_batch_rows")
