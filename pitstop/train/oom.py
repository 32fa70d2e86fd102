"""Out of memory in a training step, turned into what failed and what would fit.

Both allocators are covered: `torch.OutOfMemoryError` (CUDA) and the CPU allocator's
RuntimeError ("DefaultCPUAllocator: not enough memory"), or a plain MemoryError.
The options keep the training math (tokens per step) and follow from the micro-batch
that failed.

The back-off is here too: after a CUDA out-of-memory in a forward/backward of one
process, `halved` gives the loader's settings with micro-batches half as large and
`back_off` re-splits the loader; the loop runs the same step again (same documents,
same math; only the summation order changes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import psutil

from pitstop.core import log
from pitstop.core.errors import PitstopError
from pitstop.probe import Choice

if TYPE_CHECKING:  # the module stays light to import (tune/search.py reads is_oom)
    from pitstop.batching.loader import Loader

GIB = 1 << 30


class TrainingOutOfMemory(PitstopError):
    """A step needed more memory than the device has."""

    exit_code = 1


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc` and the exceptions it wraps (cause or context), each once."""
    out: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and all(e is not x for x in out):
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def is_oom(exc: BaseException) -> bool:
    """Whether an exception (or one it wraps) is an out-of-memory error."""
    for e in _chain(exc):
        if isinstance(e, MemoryError) or is_cuda_oom(e, wrapped=False):
            return True
        # CUDA's text, and the CPU allocator's ("DefaultCPUAllocator: not enough memory").
        text = str(e).lower()
        if isinstance(e, RuntimeError) and ("out of memory" in text or "not enough memory" in text):
            return True
    return False


def is_cuda_oom(exc: BaseException, *, wrapped: bool = True) -> bool:
    """Whether `exc` (or, with `wrapped`, one it wraps) is the CUDA allocator's out-of-memory."""
    try:
        import torch

        kind = torch.cuda.OutOfMemoryError
    except (ImportError, AttributeError):
        return False
    return any(isinstance(e, kind) for e in (_chain(exc) if wrapped else [exc]))


def device_bytes(device_type: str) -> int | None:
    """The memory a run on this device can use at most (GPU total, or host RAM)."""
    try:
        if device_type == "cuda":
            import torch

            return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)

        return int(psutil.virtual_memory().total)
    except Exception:  # no device query: the message goes without sized options
        return None


def fitting_options(*, rows: int | None, checkpointing: bool, seq_len: int) -> list[str]:
    """Settings that need less memory for the same math (tokens per step stay the same).

    Sizes follow from the failing micro-batch alone (half of it, or checkpointing): an
    out-of-memory error is a measurement, and beats any estimate of the same size.
    """
    opts = []
    if rows and rows > 1:
        opts.append(f"--micro-batch-size {rows // 2} (more accumulation, same tokens per step)")
    if not checkpointing:
        opts.append("--gradient-checkpointing")
    if not opts:
        opts.append(f"a shorter --max-seq-len than {seq_len}, or --lora-r 16")
    return opts


def oom_error(
    exc: BaseException,
    *,
    step: int,
    micro: tuple[int, int, tuple[int, ...]] | None,
    device_type: str,
    last_checkpoint: Any,
    **estimate: Any,
) -> TrainingOutOfMemory:
    """The error for an OOM in optimizer step `step` (1-based) at micro-batch `micro`."""
    where = f"optimizer step {step}"
    if micro is not None:
        m, count, shape = micro
        where += f", micro-batch {m + 1} of {count} ({' x '.join(map(str, shape))} tokens)"
    total = device_bytes(device_type)
    rows = micro[2][0] if micro is not None and micro[2] else None
    opts = fitting_options(
        rows=rows, checkpointing=estimate["checkpointing"], seq_len=estimate["seq_len"]
    )
    mem = f" of {total / GIB:.1f} GiB ({device_type})" if total else f" ({device_type})"
    fix = (
        "; options that need less memory: " + "; ".join(opts)
        if opts
        else "; try a smaller --micro-batch-size or --gradient-checkpointing"
    )
    return TrainingOutOfMemory(
        f"out of memory in {where}: it needed more than the memory{mem}{fix}. Nothing "
        f"was lost: the last checkpoint ({last_checkpoint or 'none yet'}) is intact; rerun "
        "with --resume and the new options"
    )


def halved(
    exc: BaseException, loader: Loader, *, retryable: bool, world_size: int
) -> tuple[Any, str] | None:
    """(the loader's settings with half the micro-batch, a description), or None when
    backing off cannot be done safely: not a CUDA OOM in a forward/backward, several
    processes (the other ranks would wait in a collective), a loader that cannot
    re-split (no settings), or a micro-batch of one row already."""
    if not (is_cuda_oom(exc) and retryable and world_size == 1) or loader.settings is None:
        return None
    from pitstop.batching.resolve import halve  # the decision is the batch-shape resolver's

    return halve(loader.settings)


def back_off(
    loader: Loader,
    batches: Any,
    settings: Any,
    rows: str,
    *,
    step: int,
    choices: dict[str, Choice],
    device_type: str,
    announce: bool,
) -> Any:
    """Re-split `loader` into micro-batches of `settings` after a CUDA out-of-memory in
    step `step` (1-based); returns the new batch iterator. The caller has dropped the
    step's partial gradients."""
    close = getattr(batches, "close", None)
    if close is not None:
        close()
    loader.resplit(settings)
    if device_type == "cuda":
        import torch

        torch.cuda.empty_cache()
    was = choices.get("micro_batch")
    before = f"{was.value}; " if was is not None else ""
    choices["micro_batch"] = Choice(
        rows,
        f"{before}backed off to half after a CUDA out-of-memory in step {step}; "
        "tokens per optimizer step unchanged",
    )
    if announce:
        log.warning(
            f"pitstop: warning: CUDA out of memory in step {step}: continuing with "
            f"micro-batches of {rows} (same step, same tokens); set --micro-batch-size "
            "or rerun with --remeasure to size it again"
        )
    return iter(loader)


def run_step(
    step_fn: Callable[[], None],
    run: Any,
    *,
    step: int,
    retryable: Callable[[], bool],
    micro: Callable[[], tuple[int, int, tuple[int, ...]] | None],
) -> tuple[Any, str] | None:
    """Run one optimizer step (`step_fn`); None when it trained, else the halved settings
    for `back_off` after a CUDA out-of-memory in a forward/backward of one process. Any
    other out-of-memory error stops the run (`stop_error`); other errors pass through.
    `retryable()` / `micro()`: whether the failure came from a forward/backward, and
    which micro-batch it was, as the step knew them when it failed."""
    smaller = None
    try:
        step_fn()
    except (RuntimeError, MemoryError) as e:
        if not is_oom(e):
            raise
        smaller = halved(e, run.loader, retryable=retryable(), world_size=run.env.world_size)
        if smaller is None:
            raise stop_error(e, run, step=step, micro=micro()) from None
    if smaller is not None:
        # Outside `except`: its frames hold the step's tensors. The step's partial
        # gradients go; its documents, and so the training math, stay the same.
        run.optimizer.zero_grad(set_to_none=True)
    return smaller


def stop_error(
    exc: BaseException, run: Any, *, step: int, micro: tuple[int, int, tuple[int, ...]] | None
) -> TrainingOutOfMemory:
    """The error that stops `run` (a pitstop.train.build.Run; not imported: build imports
    this module through train/compile.py) after an OOM it cannot back off from (see
    `oom_error`)."""
    try:  # a checkpoint on its way to disk: let it land before naming it
        run.writer.wait()
    except PitstopError as err:  # the write failed (CheckpointError): the OOM is the news
        log.warning(f"pitstop: {err}")
    return oom_error(
        exc,
        step=step,
        micro=micro,
        device_type=run.device.type,
        last_checkpoint=run.writer.last_written,
        model_dir=str(run.cfg.model),
        seq_len=run.geometry.max_seq_len,
        precision=run.precision,
        attention=str(run.choices["attention"].value),
        checkpointing=bool(run.cfg.gradient_checkpointing),
        lora_r=run.cfg.lora_r,
    )
