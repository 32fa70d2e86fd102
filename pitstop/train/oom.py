"""Out of memory in a training step, turned into what failed and what would fit.

Both allocators are covered: `torch.OutOfMemoryError` (CUDA) and the CPU allocator's
RuntimeError ("DefaultCPUAllocator: not enough memory"), or a plain MemoryError.
The options come from `pitstop.report.memory` (the same estimate `pitstop estimate`
prints), sized to this device's memory.
"""

from __future__ import annotations

from typing import Any

from pitstop.errors import PitstopError

GIB = 1 << 30


class TrainingOutOfMemory(PitstopError):
    """A step needed more memory than the device has."""

    exit_code = 1


def is_oom(exc: BaseException) -> bool:
    from pitstop.tune.search import is_oom as _is_oom  # one test for every command

    return _is_oom(exc)


def device_bytes(device_type: str) -> int | None:
    """The memory a run on this device can use at most (GPU total, or host RAM)."""
    try:
        if device_type == "cuda":
            import torch

            return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:  # no device query: the message goes without sized options
        return None


def fitting_options(
    model_dir: str, *, seq_len: int, precision: str, attention: str, checkpointing: bool,
    lora_r: int | None, usable: int, rows: int | None = None,
) -> list[str]:  # fmt: skip
    """--micro-batch-size values (and gradient checkpointing) estimated to fit in `usable`.

    `rows`: the micro-batch that failed. It did not fit whatever the estimate says, so a
    suggestion without checkpointing is at most half of it.
    """
    from pitstop.report.memory import max_micro_batch, shape_from_model_dir

    try:
        shape = shape_from_model_dir(model_dir)
    except Exception:  # a model the estimator cannot read: no sized options
        return []
    kw: dict[str, Any] = dict(seq_len=seq_len, precision=precision, lora_r=lora_r,
                              attention=attention if attention in ("eager", "sdpa") else "sdpa")  # fmt: skip
    opts = []
    mb = max_micro_batch(shape, usable, gradient_checkpointing=checkpointing, **kw)
    if rows:
        mb = min(mb, rows // 2)
    if mb:
        opts.append(f"--micro-batch-size {mb} (tokens per step stay the same: more accumulation)")
    if not checkpointing:
        mb_gc = max_micro_batch(shape, usable, gradient_checkpointing=True, **kw)
        if rows:
            mb_gc = min(mb_gc, rows)
        if mb_gc:
            opts.append(f"--gradient-checkpointing --micro-batch-size {mb_gc}")
    if not opts:
        opts.append(
            f"a shorter --max-seq-len than {seq_len}, or --lora-r 16 (not even one row fits)"
        )
    return opts


def oom_error(
    exc: BaseException, *, step: int, micro: tuple[int, int, tuple[int, ...]] | None,
    device_type: str, last_checkpoint: Any, **estimate: Any,
) -> TrainingOutOfMemory:  # fmt: skip
    """The error for an OOM in optimizer step `step` (1-based) at micro-batch `micro`."""
    where = f"optimizer step {step}"
    if micro is not None:
        m, count, shape = micro
        where += f", micro-batch {m + 1} of {count} ({' x '.join(map(str, shape))} tokens)"
    total = device_bytes(device_type)
    rows = micro[2][0] if micro is not None and micro[2] else None
    opts = fitting_options(usable=int(0.9 * total), rows=rows, **estimate) if total else []
    mem = f" of {total / GIB:.1f} GiB ({device_type})" if total else f" ({device_type})"
    fix = (
        "; options estimated to fit (pitstop estimate): " + "; ".join(opts)
        if opts
        else "; try a smaller --micro-batch-size or --gradient-checkpointing"
    )
    return TrainingOutOfMemory(
        f"out of memory in {where}: it needed more than the memory{mem}{fix}. Nothing "
        f"was lost: the last checkpoint ({last_checkpoint or 'none yet'}) is intact; rerun "
        "with --resume and the new options"
    )
