"""The self-test's memory checks (bench/gpu_selftest.py; docs/gpu.md):

- `check_staging`: checkpoint staging (train/checkpoint.py `HostStaging`) holds pinned host
  buffers of exactly the state's bytes (tied weights once, with a model that really ties
  them), reuses them, and its snapshot keeps the values of the moment it was taken while
  the device goes on updating the parameters (the trainer's wait on the copy's event);
- `check_sizer`: the micro-batch sizer's prediction bounds a real step's peak.
"""

from __future__ import annotations

from typing import Any

import torch

from bench.gpu_checks_util import Row, batch, tiny_llama

# A state large enough that its device-to-host copy takes milliseconds: an update that
# did not wait for it would overlap it.
GPU_STAGING_MODEL = {"layers": 4, "hidden": 1024, "heads": 8, "kv_heads": 2}


def distinct_bytes(tensors: Any) -> int:
    """Bytes of the distinct memory `tensors` cover (a view of the same memory counted
    once), measured from the tensors themselves: what a host copy must hold."""
    spans: dict[tuple[Any, ...], int] = {}
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        spans[(t.device, t.untyped_storage().data_ptr(), t.storage_offset(), nbytes)] = nbytes
    return sum(spans.values())


def _snapshot_after_update(
    staging: Any, model: Any, state: dict[str, torch.Tensor], dev: torch.device, *, wait: bool
) -> tuple[dict[str, torch.Tensor], int]:
    """Stage `state`, then update every parameter on the device at once (after waiting for
    the copy's event on the training stream, as Trainer.optimizer_step does, when `wait`),
    then wait for the copy as the writer does. Returns (the snapshot, the number of its
    tensors that do not hold the values from before the update)."""
    before = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}
    out, event = staging.stage(state)
    if event is not None and wait:
        torch.cuda.current_stream(dev).wait_event(event)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    if event is not None:
        event.synchronize()
    changed = sum(not torch.equal(out[k], before[k]) for k in state)
    return out, changed


def check_staging(dev: torch.device, precision: str) -> list[Row]:
    from pitstop.train import checkpoint as ckpt

    cuda = dev.type == "cuda"
    model = tiny_llama("sdpa", dev, tied=True, **(GPU_STAGING_MODEL if cuda else {}))
    head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    tied = head.data_ptr() == embed.data_ptr()
    state = model.state_dict()
    staging = ckpt.HostStaging()
    out, changed = _snapshot_after_update(staging, model, state, dev, wait=True)
    real = distinct_bytes(state.values())
    staged = distinct_bytes(out.values())
    keys = [k for k, v in state.items() if v.data_ptr() == embed.data_ptr()]
    tied_once = len(keys) == 2 and out[keys[0]].data_ptr() == out[keys[1]].data_ptr()
    pinned = all(t.is_pinned() for t in out.values()) if cuda else None
    allocations = staging.allocations
    _, changed_again = _snapshot_after_update(staging, model, state, dev, wait=True)
    reused = staging.allocations == allocations
    rows = []
    ok = tied and tied_once and staged == real and staging.nbytes == real and reused
    ok = ok and (pinned is not False)
    rows.append(Row("pinned checkpoint staging", "pass" if ok else "FAIL",
                    f"{staged:,} bytes in the staged buffers ({staging.nbytes:,} by its own count) "
                    f"for a state covering {real:,} bytes; weights tied in the model {tied}, "
                    f"staged once {tied_once} ({' = '.join(keys) or 'no tied keys'}); "
                    + (f"pinned {pinned}; " if cuda else "CPU: not pinned (no CUDA); ")
                    + f"buffers reused by the next checkpoint {reused}"))  # fmt: skip
    name = "staging snapshot vs a later update"
    ok = changed == 0 and changed_again == 0
    detail = (
        f"{len(state)} tensors staged, then every parameter updated on the device"
        + (" after the training stream waited on the copy's event (Trainer.optimizer_step)"
           if cuda else " (CPU: the copy is synchronous)")
        + f": tensors holding the update instead of the old values: {changed}, then "
        f"{changed_again} with the reused buffers"
    )  # fmt: skip
    if cuda:
        # The same without the wait: whether the copy really overlaps the update (what the
        # wait prevents). Informational: a race may or may not be caught in one try.
        _, raced = _snapshot_after_update(staging, model, state, dev, wait=False)
        detail += f"; without the wait {raced} of {len(state)} caught the update (informational)"
    rows.append(Row(name, "pass" if ok else "FAIL", detail))
    return rows


def check_sizer(dev: torch.device, precision: str) -> list[Row]:
    from pitstop.probe import Choice
    from pitstop.train.forward import token_loss_sum
    from pitstop.train.memory_plan import cuda_sizer
    from pitstop.train.optim import build_optimizer

    name = "sizer vs actual peak"
    if dev.type != "cuda":
        return [Row(name, "skip", "the sizer measures CUDA memory")]
    autocast = torch.bfloat16 if precision == "bf16" else None
    model = tiny_llama("sdpa", dev)
    choice = Choice("adamw_fused", "selftest")
    sizer = cuda_sizer(model, dev, "sdpa", autocast, choice)
    mb = {k: v.cpu() for k, v in batch(dev, rows=4, width=256).items()}
    measured, _ = sizer.measure(mb)
    predicted = measured + sizer.reserved_bytes
    opt = build_optimizer(model, lr=1e-4, weight_decay=0.0, choice=choice)
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    on_dev = {k: v.to(dev) for k, v in mb.items()}
    token_loss_sum(model, on_dev, dev.type, autocast).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    token_loss_sum(model, on_dev, dev.type, autocast).backward()  # with the moments alive
    torch.cuda.synchronize(dev)
    actual = float(torch.cuda.max_memory_allocated(dev))
    ok = actual <= predicted * 1.05
    return [Row(name, "pass" if ok else "FAIL",
                f"predicted {predicted / 2**20:.1f} MiB (measured {measured / 2**20:.1f} + "
                f"reserved {sizer.reserved_bytes / 2**20:.1f}); actual step peak "
                f"{actual / 2**20:.1f} MiB")]  # fmt: skip
