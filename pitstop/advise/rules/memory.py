"""Rules about memory and recomputation (gradient checkpointing)."""

from __future__ import annotations

import os

from pitstop.advise.finding import Finding
from pitstop.advise.rules.context import Context, lora_rank, rule
from pitstop.measure.cost_model import Plan, is_eight_bit, plan_cost
from pitstop.measure.verdict import COMPUTE_PHASES
from pitstop.probe import DeviceInfo


def micro_batch_tokens(ctx: Context) -> int | None:
    s = ctx.setup
    if s.tokens_per_micro_batch:
        return s.tokens_per_micro_batch
    length = s.max_len or (ctx.data.p99 if ctx.data else None)
    if s.micro_batch_rows and length:
        return s.micro_batch_rows * length
    return None


def cost_plan(ctx: Context, tokens: int, *, gradient_checkpointing: bool) -> Plan:
    """The cost model's plan of this setup, for a micro-batch of `tokens` positions: the
    same plan `pitstop estimate` prices for the same flags."""
    s = ctx.setup
    length = s.max_len or (ctx.data.p99 if ctx.data else None) or tokens
    rows = max(1, tokens // length) if length <= tokens else 1
    lora_r = lora_rank(ctx)
    if ctx.cuda:  # pitstop picks fused AdamW on CUDA; an HF run uses the `optim` it names
        fused = s.source == "pitstop" or "fused" in (s.optimizer or "") or is_eight_bit(s.optimizer)
    else:
        fused = is_eight_bit(s.optimizer)
    return Plan(
        micro_batch_size=rows, seq_len=min(length, tokens), precision=ctx.precision,
        attention="eager" if s.attention == "eager" else "sdpa",
        gradient_checkpointing=gradient_checkpointing, lora_r=lora_r,
        load_in_4bit=bool(s.load_in_4bit and lora_r is not None), grad_accum=s.grad_accum or 1,
        fused_optimizer=fused, optimizer="adamw_8bit" if is_eight_bit(s.optimizer) else "adamw",
    )  # fmt: skip


def device_memory_bytes(dev: DeviceInfo) -> int | None:
    """The memory a run can fill: the GPU's, or on a CPU the machine's physical RAM."""
    if dev.total_memory_bytes:
        return int(dev.total_memory_bytes)
    if dev.type == "cpu":
        try:
            return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        except (ValueError, OSError, AttributeError):  # not POSIX: unknown
            return None
    return None


@rule("gradient-checkpointing-unneeded")
def checkpointing_unneeded(ctx: Context) -> Finding | None:
    """On every device: recomputation costs compute on a CPU as on a GPU."""
    s, m, dev = ctx.setup, ctx.model, ctx.device
    memory = device_memory_bytes(dev)
    if not s.gradient_checkpointing or not memory or m is None:
        return None
    tokens = micro_batch_tokens(ctx)
    if not tokens and s.micro_batch_rows and m.max_positions:
        # No max length and no data (TrainingArguments): rows at the model's longest context
        # bound the activations from above, so "fits" here holds for every row length.
        tokens = s.micro_batch_rows * m.max_positions
    if not tokens:
        return None
    shape = m.cost_shape()
    cuda = dev.type == "cuda"
    with_ck = plan_cost(
        shape, cost_plan(ctx, tokens, gradient_checkpointing=True), memory, cuda=cuda
    )
    without = plan_cost(shape, cost_plan(ctx, tokens, gradient_checkpointing=False), memory, cuda=cuda)  # fmt: skip
    # The doctor sets aside a profile of another device or model (profile-other-target).
    peak = (ctx.profile or {}).get("peak_memory_bytes")
    plan = without.plan
    what = f"LoRA r={plan.lora_r}" if plan.lora_r is not None else "full fine-tuning"
    if plan.load_in_4bit:
        what = "Q" + what + " (4-bit base)"
    if peak:
        estimate = float(peak) - with_ck.memory.peak + without.memory.peak
        how = f"measured peak with checkpointing + the cost model's extra activations ({what})"
    else:
        estimate = float(without.memory.peak)
        how = f"estimated by the cost model for {what}, as `pitstop estimate` prices it"
    budget = without.usable_bytes
    if budget is None or estimate > budget:
        return None
    compute = sum(ctx.shares.get(p, 0.0) for p in COMPUTE_PHASES) if ctx.profile else 1.0
    share = without.recompute_share
    saved = share / (1 + share)
    return Finding(
        id="gradient-checkpointing-unneeded",
        severity="high",
        title="gradient checkpointing is on, but the run fits in memory without it",
        evidence={"estimated_peak_without_bytes": int(estimate), "usable_bytes": budget,
                  "device_memory_bytes": memory, "micro_batch_tokens": tokens, "how": how,
                  "plan": {"micro_batch_size": plan.micro_batch_size, "seq_len": plan.seq_len,
                           "precision": plan.precision, "lora_r": plan.lora_r,
                           "load_in_4bit": plan.load_in_4bit, "optimizer": plan.optimizer,
                           "fused_optimizer": plan.fused_optimizer},
                  "flops_per_token": without.flops_per_token,
                  "recompute_flops_per_token": with_ck.recompute_per_token,
                  "recompute_share": round(share, 4),
                  "memory_basis": "pitstop.measure.cost_model (docs/cost-model.md)"},
        effect=f"recomputation runs the forward pass again during backward ({what}: "
        f"+{with_ck.recompute_per_token:.3g} FLOPs per token = 2·N + 4·L·d·T on top of "
        f"{without.flops_per_token:.3g}), i.e. ≈{share:.0%} more compute per step; turning it "
        f"off saves ≈{saved:.0%} of forward+backward time",
        basis="FLOPs arithmetic",
        fix=s.fix("--no-gradient-checkpointing",
                  "gradient_checkpointing=False" if s.transformers_major < 5 or "gradient_checkpointing" in s.raw
                  else "activation_checkpointing=False (gradient_checkpointing in transformers < 5)"),
        gain=saved * compute,
    )  # fmt: skip
