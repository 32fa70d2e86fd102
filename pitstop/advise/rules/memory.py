"""Rules about memory and recomputation (gradient checkpointing)."""

from __future__ import annotations

import os

from pitstop.advise.finding import Finding
from pitstop.advise.rules.context import Context, lora_rank, pct, rule
from pitstop.advise.setup import UNKNOWN, Setup
from pitstop.core import host_malloc
from pitstop.measure.cost_model import Plan, PlanCost, is_eight_bit, plan_cost
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


def cost_plan(
    ctx: Context, tokens: int, *, gradient_checkpointing: bool, length: int | None = None
) -> Plan:
    """The cost model's plan of this setup, for a micro-batch of `tokens` positions in rows
    of `length` (default: the max length, else the data's p99): the same plan `pitstop
    estimate` prices for the same flags."""
    s = ctx.setup
    length = length or s.max_len or (ctx.data.p99 if ctx.data else None) or tokens
    rows = max(1, tokens // length) if length <= tokens else 1
    lora_r = lora_rank(ctx)
    # pitstop picks fused AdamW on CUDA; an HF run uses the `optim` it names. A run that did
    # not record its optimizer is priced unfused: the larger memory, so "fits" holds either way.
    # A CPU run is priced unfused too (pitstop's CPU runs were foreach before fused AdamW):
    # one fp32 copy of the parameters more than a fused run needs, a bound that still holds.
    if ctx.cuda:
        fused = s.source == "pitstop" or "fused" in (s.optimizer or "") or is_eight_bit(s.optimizer)
    else:
        fused = is_eight_bit(s.optimizer)
    return Plan(
        micro_batch_size=rows,
        seq_len=min(length, tokens),
        precision=ctx.precision,
        attention="eager" if s.attention == "eager" else "sdpa",
        gradient_checkpointing=gradient_checkpointing,
        lora_r=lora_r,
        load_in_4bit=bool(s.load_in_4bit and lora_r is not None),
        grad_accum=s.grad_accum or 1,
        fused_optimizer=fused,
        optimizer="adamw_8bit" if is_eight_bit(s.optimizer) else "adamw",
    )


def optimizer_known(ctx: Context) -> bool:
    """pitstop's optimizer follows from the device; an HF setup's from `optim`, if it said."""
    return ctx.setup.source == "pitstop" or ctx.setup.optimizer is not None


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


def _checkpointed_rows(ctx: Context) -> tuple[int, int | None] | None:
    """(positions per micro-batch, the row length when it had to be assumed) of the plan
    to price, or None when the setup says too little to price one."""
    s, m = ctx.setup, ctx.model
    tokens = micro_batch_tokens(ctx)
    if tokens:
        return tokens, None  # the row length of the plan: the max length or the data's p99
    if s.micro_batch_rows and m is not None and m.max_positions:
        # No max length and no data (TrainingArguments, a custom loop): rows at the model's
        # longest context bound the activations from above, so "fits" holds for every row
        # length. The plan is those rows at that length, not one row of all their positions.
        return s.micro_batch_rows * m.max_positions, m.max_positions
    return None


def _priced(
    ctx: Context, tokens: int, length: int | None, memory: int, *, checkpointing: bool
) -> PlanCost:
    assert ctx.model is not None
    plan = cost_plan(ctx, tokens, gradient_checkpointing=checkpointing, length=length)
    return plan_cost(ctx.model.cost_shape(), plan, memory, cuda=ctx.device.type == "cuda")


def _trained(plan: Plan) -> str:
    """What the plan trains, as the finding names it: full fine-tuning, LoRA or QLoRA."""
    what = f"LoRA r={plan.lora_r}" if plan.lora_r is not None else "full fine-tuning"
    return "Q" + what + " (4-bit base)" if plan.load_in_4bit else what


def _peak_without(
    ctx: Context, with_ck: PlanCost, without: PlanCost, length: int | None
) -> tuple[float, str]:
    """The peak without checkpointing, and how it was found: a measured peak plus the
    activations recomputation saved, else the cost model's estimate."""
    what = _trained(without.plan)
    # The doctor sets aside a profile of another device or model (profile-other-target).
    peak = (ctx.profile or {}).get("peak_memory_bytes")
    if peak:
        estimate = float(peak) - with_ck.memory.peak + without.memory.peak
        how = f"measured peak with checkpointing + the cost model's extra activations ({what})"
    else:
        estimate = float(without.memory.peak)
        how = f"estimated by the cost model for {what}, as `pitstop estimate` prices it"
    if length is not None:
        how += (
            f"; the row length was not recorded: rows of the model's {length} positions, "
            "the longest, bound it"
        )
    if not optimizer_known(ctx):
        how += "; the optimizer was not recorded: priced unfused (the larger memory)"
    return estimate, how


def _hf_off(s: Setup) -> str:
    """The Hugging Face argument that turns recomputation off."""
    # transformers 5 renamed the argument; a file that already uses the old name keeps it.
    if s.transformers_major < 5 or "gradient_checkpointing" in s.raw:
        return "gradient_checkpointing=False"
    return "activation_checkpointing=False (gradient_checkpointing in transformers < 5)"


@rule("gradient-checkpointing-unneeded")
def checkpointing_unneeded(ctx: Context) -> Finding | None:
    """On every device: recomputation costs compute on a CPU as on a GPU. Fires when the
    plan without it (priced by the cost model, or a measured peak plus what it saves) fits."""
    s, m = ctx.setup, ctx.model
    memory = device_memory_bytes(ctx.device)
    if not s.gradient_checkpointing or not memory or m is None or ctx.precision == UNKNOWN:
        return None
    rows = _checkpointed_rows(ctx)
    if rows is None:
        return None
    tokens, length = rows
    with_ck = _priced(ctx, tokens, length, memory, checkpointing=True)
    without = _priced(ctx, tokens, length, memory, checkpointing=False)
    estimate, how = _peak_without(ctx, with_ck, without, length)
    budget = without.usable_bytes
    if budget is None or estimate > budget:
        return None
    plan, what = without.plan, _trained(without.plan)
    compute = sum(ctx.shares.get(p, 0.0) for p in COMPUTE_PHASES) if ctx.profile else 1.0
    share = without.recompute_share
    saved = share / (1 + share)
    return Finding(
        id="gradient-checkpointing-unneeded",
        severity="high",
        title="gradient checkpointing is on, but the run fits in memory without it",
        evidence={
            "estimated_peak_without_bytes": int(estimate),
            "usable_bytes": budget,
            "device_memory_bytes": memory,
            "how": how,
            # an upper bound where the row length is unknown: labelled as one
            "micro_batch_tokens": tokens if length is None else UNKNOWN,
            "micro_batch_tokens_at_most": None if length is None else tokens,
            "plan": {
                "micro_batch_size": plan.micro_batch_size,
                "seq_len": plan.seq_len if length is None else UNKNOWN,
                "seq_len_at_most": None if length is None else plan.seq_len,
                "precision": plan.precision,
                "lora_r": plan.lora_r,
                "load_in_4bit": plan.load_in_4bit,
                "optimizer": plan.optimizer if optimizer_known(ctx) else UNKNOWN,
                "fused_optimizer": plan.fused_optimizer if optimizer_known(ctx) else UNKNOWN,
            },
            "flops_per_token": without.flops_per_token,
            "recompute_flops_per_token": with_ck.recompute_per_token,
            "recompute_share": round(share, 4),
            "memory_basis": "pitstop.measure.cost_model (docs/cost-model.md)",
        },
        effect=f"recomputation runs the forward pass again during backward ({what}: "
        f"+{with_ck.recompute_per_token:.3g} FLOPs per token = 2·N + 4·L·d·T on top of "
        f"{without.flops_per_token:.3g}), i.e. ≈{share:.0%} more compute per step; turning it "
        f"off saves ≈{saved:.0%} of forward+backward time",
        basis="FLOPs arithmetic",
        fix=s.fix(
            "--no-gradient-checkpointing",
            _hf_off(s),
            "drop the model.gradient_checkpointing_enable() call (or the "
            "torch.utils.checkpoint wrappers) from the training script",
        ),
        gain=saved * compute,
    )


# A step whose page faults cost at least this share of it gets the finding (low below
# HOST_FAULTS_MEDIUM, medium below HOST_FAULTS_HIGH). pitstop's choices, not measurements.
HOST_FAULTS_MIN, HOST_FAULTS_MEDIUM, HOST_FAULTS_HIGH = 0.03, 0.08, 0.2
# glibc keeps freed memory for reuse with these (pitstop/core/host_malloc.py sets the same
# from inside a `pitstop train` process; a script's process reads them at start).
GLIBC_KEEP_ENV = " ".join(f"{k}={v}" for k, v in host_malloc.KEEP_ENV.items())


@rule("host-page-faults")
def host_page_faults(ctx: Context) -> Finding | None:
    """A CPU run that faults its memory in again every step: the allocator handed the step's
    tensors back to the OS, and the kernel maps and zero-fills them on their next first
    touch. The time is the faults per step counted by the kernel times what one fault cost
    on this machine (both in the profile), over the step."""
    p = ctx.profile
    if not p or ctx.cuda:
        return None
    faults, each = p.get("host_page_faults_per_step"), p.get("page_fault_seconds")
    step = ctx.base_step_seconds()
    if not faults or not each or not step:
        return None
    share = min(faults * each / step, 1.0)
    if share < HOST_FAULTS_MIN:
        return None
    s = ctx.setup
    fix = s.fix(
        "--keep-freed-memory auto (the default: on for a CPU run)",
        f"start the script with {GLIBC_KEEP_ENV} in its environment (glibc keeps freed "
        "memory for the next step), or with LD_PRELOAD of jemalloc or tcmalloc",
    )
    return Finding(
        id="host-page-faults",
        severity="high"
        if share >= HOST_FAULTS_HIGH
        else ("medium" if share >= HOST_FAULTS_MEDIUM else "low"),
        title=f"{faults:,.0f} page faults a step: the allocator hands the step's memory back "
        "to the OS and the kernel maps it in again",
        evidence={
            "page_faults_per_step": round(faults),
            "page_fault_us": round(each * 1e6, 2),
            "step_seconds": round(step, 4),
        },
        effect=f"{faults:,.0f} faults x {each * 1e6:.2f} us (one fault, measured here) = "
        f"{faults * each:.3f} s of a {step:.3f} s step ({pct(share)}); kept memory is reused "
        "without faults (the same math: only where the tensors live changes)",
        basis="measured in this profile",
        fix=fix,
        gain=share,
        gain_measured=True,
    )
