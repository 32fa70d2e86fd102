"""Rules about correctness and folklore: the gradient-accumulation loss bug, TF32 with half precision, empty_cache, a changed effective batch."""

from __future__ import annotations

from pitstop.advise.finding import Finding
from pitstop.advise.rules.context import Context, rule

GA_FIX_VERSION = (4, 46, 0)


def _version_tuple(v: str | None) -> tuple[int, ...] | None:
    if not v:
        return None
    parts = []
    for p in v.split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts) if parts else None


@rule("ga-loss-bug", sources=("hf",))
def ga_loss_bug(ctx: Context) -> Finding | None:
    """pitstop normalises the loss by the target tokens of the whole optimizer step: HF only."""
    if ctx.setup.custom_loop:  # a loop of its own scales its own loss: not the Trainer's bug
        return None
    ga = ctx.setup.grad_accum or 1
    ver = ctx.transformers or ctx.env.get("transformers")
    vt = _version_tuple(ver)
    if ga <= 1 or vt is None or vt >= GA_FIX_VERSION:
        return None
    return Finding(
        id="ga-loss-bug",
        severity="high",
        title=f"transformers {ver} with gradient_accumulation_steps={ga}: accumulated loss is mis-normalised",
        evidence={"transformers": ver, "gradient_accumulation_steps": ga, "fixed_in": "4.46.0"},
        effect="before 4.46 the Trainer averaged each micro-batch's mean loss, so micro-batches with "
        "few target tokens weigh as much as full ones: the result differs from the same batch "
        "without accumulation (it changes what is learned, not the speed)",
        basis="documented",
        reference="transformers v4.46.0 release notes; https://huggingface.co/blog/gradient_accumulation (Oct 2024)",
        fix='pip install -U "transformers>=4.46" (a custom compute_loss must also accept num_items_in_batch)',
        gain=0.0,
    )


@rule("tf32-with-16-bit", sources=("hf",))
def tf32_with_half_precision(ctx: Context) -> Finding | None:
    """pitstop has no TF32 option: the probe enables it and says it only affects fp32 ops."""
    if not ctx.setup.tf32 or ctx.precision not in ("bf16", "fp16"):
        return None
    return Finding(
        id="tf32-with-16-bit",
        severity="low",
        title=f"tf32=True does not speed up {ctx.precision} training",
        evidence={"tf32": True, "precision": ctx.precision},
        effect=f"TF32 applies only to fp32 matmuls and convolutions; under {ctx.precision} autocast "
        "the matmuls already run in 16-bit, so no speed-up should be expected from it (harmless)",
        basis="documented",
        reference="https://pytorch.org/docs/stable/notes/cuda.html#tensorfloat-32-tf32-on-ampere-and-later-devices",
        fix="no change needed; do not count tf32=True as a speed-up (it only matters with bf16=False, fp16=False)",
    )


@rule("empty-cache")
def empty_cache(ctx: Context) -> Finding | None:
    """HF: `torch_empty_cache_steps`. pitstop never calls empty_cache; a profile note flags custom code."""
    s = ctx.setup
    notes = [n for n in (ctx.profile or {}).get("notes") or [] if "empty_cache" in str(n)]
    if s.empty_cache_steps is None and not notes:
        return None
    return Finding(
        id="empty-cache",
        severity="medium",
        title="torch.cuda.empty_cache() is called during training"
        + (f" every {s.empty_cache_steps} steps" if s.empty_cache_steps else ""),
        evidence={"torch_empty_cache_steps": s.empty_cache_steps, "profile_notes": notes or None},
        effect="emptying the cache hands memory back to the driver; the next steps allocate it again "
        "with synchronising cudaMalloc calls (transformers documents ~10% slower training); it "
        "helps only against fragmentation OOMs, where PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
        "is the better fix",
        basis="documented",
        reference="transformers TrainingArguments.torch_empty_cache_steps help; https://pytorch.org/docs/stable/notes/cuda.html#memory-management",
        fix=s.fix(
            "remove torch.cuda.empty_cache() calls from custom code",
            "torch_empty_cache_steps=None (remove it)",
            "remove the torch.cuda.empty_cache() calls from the training loop",
        ),
        gain=0.05,
    )


@rule("effective-batch-changed")
def effective_batch_changed(ctx: Context) -> Finding | None:
    b = ctx.baseline
    if b is None:
        return None
    # Units that match the batching: HF batches padded per batch (or bucketed) hold a fixed
    # number of rows whose length varies, so rows x max length counts no real quantity.
    rows_batched = ctx.setup.source == "hf" and not ctx.setup.packed
    old, new = b.effective_tokens_per_step, ctx.setup.effective_tokens_per_step
    unit = "positions"
    if rows_batched or old is None or new is None:
        old, new, unit = b.rows_per_step, ctx.setup.rows_per_step, "rows"
    if old is None or new is None or old == new:
        return None
    s = ctx.setup
    if unit == "positions":
        pitstop_fix = f"--tokens-per-step {old}"
    else:
        pitstop_fix = "keep --micro-batch-size x --grad-accum x --nproc equal to the baseline"
    return Finding(
        id="effective-batch-changed",
        severity="high",
        title=f"the effective batch changed: {old} -> {new} {unit} per optimizer step",
        evidence={
            "baseline": old,
            "this": new,
            "unit": unit,
            "rows_per_device": s.micro_batch_rows,
            "accumulation": s.grad_accum,
            "processes": s.world,
        },
        effect="per-device batch x accumulation x processes sets the gradient noise and the number "
        "of optimizer steps; changing it changes what is learned, so a faster step is not a free "
        "speed-up (compare runs at equal tokens per optimizer step)",
        basis="FLOPs arithmetic",
        fix=s.fix(
            pitstop_fix,
            "per_device_train_batch_size x gradient_accumulation_steps x world size = "
            f"{old} {unit} (as in the baseline)",
        ),
    )
