"""Audit rules over a training setup, the data's lengths, the device and a measured profile.

Each rule is a function of a `Context` returning a `Finding` or None, registered
with the sources it applies to ("pitstop", "hf"). A rule whose inputs are missing
(no profile, no data, no GPU) stays quiet rather than guessing. Every effect
states its basis: measured in the given profile, computed from the data's
lengths, FLOPs arithmetic (6·N + 12·L·d·T per token, pitstop/measure/cost_model.py),
or documented (with a reference). Where a rule cannot apply to a source, the
reason is in its docstring (`RULES` lists them).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pitstop.advise.facts import DataFacts, ModelFacts, random_batch_padding
from pitstop.advise.finding import Finding
from pitstop.advise.setup import Setup
from pitstop.measure.cost_model import Plan, is_eight_bit, plan_cost
from pitstop.measure.peak import gpu_peak
from pitstop.measure.verdict import (
    BUSY_LOAD_PER_CORE,
    CHECKPOINT_SEVERE,
    COMPUTE_PHASES,
    INPUT_MODERATE,
    INPUT_SEVERE,
    OPTIMIZER_MODERATE,
    OPTIMIZER_SEVERE,
    Verdict,
    phase_shares,
    verdict,
)
from pitstop.probe import (
    COMPILE_GAIN_BASIS,
    COMPILE_SECONDS_BASIS,
    DeviceInfo,
    PrecisionSpeed,
    choose_precision,
)

# A fix should bring a periodic cost under this share of the run (pitstop's target).
PERIODIC_TARGET = 0.01
CHECKPOINT_LIMIT, LOGGING_LIMIT, EVAL_LIMIT = 0.02, 0.01, 0.01
PADDING_LIMIT = 0.10  # padding waste worth acting on
TRUNCATION_LIMIT = 0.01  # share of tokens cut off worth reporting
MAX_LEN_OVER_P99 = 2.0  # "far above p99"
GA_FIX_VERSION = (4, 46, 0)


@dataclass
class Context:
    setup: Setup
    device: DeviceInfo
    env: dict[str, Any] = field(default_factory=dict)
    data: DataFacts | None = None
    model: ModelFacts | None = None
    profile: dict[str, Any] | None = None
    baseline: Setup | None = None
    transformers: str | None = None  # the target's release; None: the installed one (env)
    # What `--precision auto` measured on this CPU (doctor.planned_precision); None: unmeasured
    measured_precision: PrecisionSpeed | None = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def verdict(self) -> Verdict | None:
        return verdict(self.profile) if self.profile else None

    @property
    def shares(self) -> dict[str, float]:
        return phase_shares(self.profile)[0] if self.profile else {}

    @property
    def precision(self) -> str:
        """The precision the run uses; `auto` resolved the way pitstop's probe resolves it."""
        p = self.setup.precision
        return p if p != "auto" else choose_precision(p, self.device, self.measured_precision).value

    def base_step_seconds(self) -> float | None:
        """Mean step seconds without the periodic phases (checkpoint, eval, logging)."""
        if not self.profile:
            return None
        ph = self.profile.get("phases") or {}
        total = float(sum(self.profile.get("step_seconds") or [])) or sum(ph.values())
        k = max(1, int(self.profile.get("steps") or 1))
        periodic = sum(float(ph.get(p, 0.0)) for p in ("checkpoint", "eval", "logging"))
        return max(total - periodic, 0.0) / k or None


Rule = Callable[[Context], Finding | None]
RULES: list[tuple[str, tuple[str, ...], Rule]] = []


def rule(rule_id: str, sources: tuple[str, ...] = ("pitstop", "hf")) -> Callable[[Rule], Rule]:
    def deco(fn: Rule) -> Rule:
        RULES.append((rule_id, sources, fn))
        return fn

    return deco


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _suggest_workers(ctx: Context) -> int:
    # A pre-tokenized store needs little CPU per batch; a few workers keep the queue full,
    # and one core stays free for the training process itself. A target machine whose
    # cores are unknown (cpu_count 0, see advise/target.py) gets the cap.
    cores = ctx.device.cpu_count
    return 4 if cores <= 0 else max(1, min(4, cores - 1))


def _input_bound_workers(ctx: Context) -> int | None:
    """The worker count an input-bound run should try: never fewer than it has (a run that
    waits for data with N workers is not helped by fewer). None when it already has every
    core it can use (the cores minus one for the training process)."""
    k = _suggest_workers(ctx)
    have = ctx.setup.loader_workers or 0
    if k > have:
        return k
    cores = ctx.device.cpu_count
    room = 2 * have if cores <= 0 else min(2 * have, cores - 1)
    return room if room > have else None


# --- input ---------------------------------------------------------------------------------


@rule("input-bound")
def input_bound(ctx: Context) -> Finding | None:
    v = ctx.verdict
    share = ctx.shares.get("data_wait", 0.0)
    if v is None or share < INPUT_MODERATE:
        return None
    workers = ctx.setup.loader_workers
    k = _input_bound_workers(ctx)
    if k is None:  # the loader already has every core it can use: the per-batch work is the cost
        pitstop_fix = (
            f"keep --loader-workers {workers} (no core is left for more); make each batch "
            "cheaper: a prepared token store on local disk, no per-batch tokenization"
        )
        hf_fix = (
            f"keep dataloader_num_workers={workers} (no core is left for more); tokenize "
            "before training (dataset.map), not in __getitem__ or the collator; "
            "dataloader_pin_memory=True, dataloader_persistent_workers=True"
        )
    else:
        pitstop_fix = (
            f"--loader-workers {k} (loading in worker processes overlaps the step); "
            "keep the data as a prepared token store on local disk"
        )
        hf_fix = (
            f"dataloader_num_workers={k}, dataloader_pin_memory=True, "
            "dataloader_persistent_workers=True; tokenize before training (dataset.map), not in __getitem__"
        )
    return Finding(
        id="input-bound",
        severity="high" if share >= INPUT_SEVERE else "medium",
        title=f"steps wait for data {_pct(share)} of the time ({'severe' if share >= INPUT_SEVERE else 'moderate'} input-bound)",
        evidence={"data_wait_share": round(share, 4), "loader_workers": workers,
                  "cpu_cores": ctx.device.cpu_count or None,
                  "thresholds": {"moderate": INPUT_MODERATE, "severe": INPUT_SEVERE}},
        effect=f"up to {_pct(share)} shorter steps if loading overlaps compute completely",
        basis="measured in this profile",
        fix=ctx.setup.fix(pitstop_fix, hf_fix),
        gain=share,
    )  # fmt: skip


@rule("loader-main-process")
def loader_main_process(ctx: Context) -> Finding | None:
    """pitstop's default (loader_workers unset) picks workers from the CPU count: quiet."""
    if ctx.setup.loader_workers != 0:
        return None
    if ctx.shares.get("data_wait", 0.0) >= INPUT_MODERATE:
        return None  # input-bound reports it, with the measured share and the same fix
    share = ctx.shares.get("data_wait")
    k = _suggest_workers(ctx)
    measured = share is not None
    return Finding(
        id="loader-main-process",
        severity="high" if (share or 0) >= INPUT_SEVERE else "medium" if (measured and share >= INPUT_MODERATE) or (not measured and ctx.cuda) else "low",
        title="batches are loaded on the training process (0 loader workers)",
        evidence={"loader_workers": 0, "cpu_cores": ctx.device.cpu_count or None,
                  "data_wait_share": None if share is None else round(share, 4)},
        effect=(f"the {_pct(share)} of step time spent loading would overlap compute"
                if measured else
                "every batch is read and collated between steps while the device waits; "
                "with workers it overlaps the previous step"),
        basis="measured in this profile" if measured else "documented",
        reference=None if measured else "https://pytorch.org/docs/stable/data.html#single-and-multi-process-data-loading",
        fix=ctx.setup.fix(f"--loader-workers {k}", f"dataloader_num_workers={k}"),
        gain=share or 0.0,
    )  # fmt: skip


@rule("loader-workers-exceed-cores")
def workers_exceed_cores(ctx: Context) -> Finding | None:
    w = ctx.setup.loader_workers
    cores = ctx.device.cpu_count
    if w is None or cores <= 0 or w <= max(1, cores - 1):
        return None
    if ctx.shares.get("data_wait", 0.0) >= INPUT_MODERATE:
        return None  # the run waits for data: input-bound's advice holds, never fewer workers
    k = max(1, cores - 1)
    return Finding(
        id="loader-workers-exceed-cores",
        severity="low",
        title=f"{w} loader workers on {cores} CPU cores",
        evidence={"loader_workers": w, "cpu_cores": cores},
        effect="workers compete with the training process (which launches the kernels) for "
        "cores; more workers than cores adds context switches, not throughput",
        basis="documented",
        reference="https://pytorch.org/docs/stable/data.html (DataLoader warns when num_workers exceeds the CPUs)",
        fix=ctx.setup.fix(f"--loader-workers {k}", f"dataloader_num_workers={k}"),
    )


# --- padding and sequence length -----------------------------------------------------------


def _padding(ctx: Context) -> tuple[float, str] | None:
    """(padding fraction, how it was computed) for this setup on this data, or None."""
    d, s = ctx.data, ctx.setup
    if d is None or not s.batching_is_padded:
        return None
    if s.batching == "pad" and s.max_len:
        row = d.padding_to(s.max_len)
        if row is None:
            return None
        return float(row["padding_fraction"]), f"every row padded to {s.max_len} tokens"
    if s.batching == "dynamic" and d.lengths is not None and s.micro_batch_rows:
        waste = random_batch_padding(d.lengths, s.micro_batch_rows, s.max_len)
        return waste, (
            f"random batches of {s.micro_batch_rows} rows padded to their longest row"
            + (f", rows cut at {s.max_len}" if s.max_len else "")
        )
    return None


def _packing_fix(ctx: Context) -> str:
    s = ctx.setup
    if s.source == "pitstop":
        return (
            "--batching pack (or --batching auto, which times pack, bucket and pad on this model)"
        )
    if s.hf_class == "SFTConfig":
        return ("packing=True (SFTConfig; with the default packing_strategy='bfd' TRL trains padding-free, "
                "which needs attn_implementation='flash_attention_2' to keep documents from attending "
                f"to each other), or {s.group_by_length_fix}")  # fmt: skip
    return (f"{s.group_by_length_fix} (TrainingArguments), or train with TRL's SFTTrainer and "
            "SFTConfig(packing=True)")  # fmt: skip


@rule("padding-waste")
def padding_waste(ctx: Context) -> Finding | None:
    got = _padding(ctx)
    if got is None or got[0] < PADDING_LIMIT:
        return None
    waste, how = got
    return Finding(
        id="padding-waste",
        severity="high" if waste >= 0.3 else "medium",
        title=f"{_pct(waste)} of computed positions are padding",
        evidence={"padding_fraction": round(waste, 4), "how": how, "batching": ctx.setup.batching,
                  "max_len": ctx.setup.max_len, "store": ctx.data.store if ctx.data else None},
        effect=f"packing computes {_pct(waste)} fewer positions for the same tokens "
        "(attention per position also shrinks when rows get shorter)",
        basis="computed from the data",
        fix=_packing_fix(ctx),
        gain=waste,
    )  # fmt: skip


def _measured_padding(ctx: Context) -> float | None:
    """Padding share the profile measured (positions computed vs non-padding tokens), if any."""
    p = ctx.profile or {}
    seen, padded = p.get("seen_tokens"), p.get("padded_tokens")
    if isinstance(seen, (int, float)) and isinstance(padded, (int, float)) and padded > 0:
        return max(0.0, 1 - float(seen) / float(padded))
    return None


@rule("packing-off")
def packing_off(ctx: Context) -> Finding | None:
    """Fires only when the data cannot compute the waste (padding-waste does that), and only
    where padding exists: a measured share at or above the limit, or rows that can be padded
    (one row per dynamically padded batch has nothing to pad to)."""
    s = ctx.setup
    if not s.batching_is_padded or ctx.data is not None:
        return None
    if s.source == "hf" and s.hf_class != "SFTConfig" and s.batching != "dynamic":
        return None
    measured = _measured_padding(ctx)
    if measured is not None and measured < PADDING_LIMIT:
        return None
    if measured is None and s.batching == "dynamic" and s.micro_batch_rows == 1:
        return None  # each batch is padded to its own longest (and only) row: no padding
    if measured is not None:
        return Finding(
            id="packing-off",
            severity="high" if measured >= 0.3 else "medium",
            title=f"{_pct(measured)} of computed positions were padding (measured)",
            evidence={"batching": s.batching, "max_len": s.max_len,
                      "padding_fraction": round(measured, 4)},
            effect=f"packing computes {_pct(measured)} fewer positions for the same tokens",
            basis="measured in this profile",
            fix=_packing_fix(ctx),
            gain=measured,
        )  # fmt: skip
    return Finding(
        id="packing-off",
        severity="low",
        title="sequences are padded, not packed (waste not measured: no data given)",
        evidence={"batching": s.batching, "max_len": s.max_len,
                  "micro_batch_rows": s.micro_batch_rows},
        effect="every padded position costs the same FLOPs as a real token; give the data "
        "(--data FILE_OR_STORE) to compute the waste",
        basis="FLOPs arithmetic",
        fix=_packing_fix(ctx),
    )  # fmt: skip


@rule("max-len-above-p99")
def max_len_above_p99(ctx: Context) -> Finding | None:
    s, d = ctx.setup, ctx.data
    if d is None or not s.max_len or d.p99 is None or s.max_len < MAX_LEN_OVER_P99 * d.p99:
        return None
    rec = (d.stats.get("recommended_max_len") or {}).get("value")
    target = int(rec) if isinstance(rec, (int, float)) and rec < s.max_len else None
    if target is None:
        target = 1 << max(3, math.ceil(math.log2(d.p99)))  # the next power of two holding p99
    ev: dict[str, Any] = {"max_len": s.max_len, "p99": d.p99, "suggested": target}
    if s.batching == "pack" and ctx.model is not None:
        fm = ctx.model.flops(lora_rank(ctx))  # the cost model's counts, LoRA-aware
        a, b = fm.per_token(s.max_len), fm.per_token(target)
        gain = 1 - b / a
        ev["flops_per_token"] = {str(s.max_len): a, str(target): b}
        effect = (f"packed rows of {target} instead of {s.max_len} cut attention FLOPs: "
                  f"{a:.3g} -> {b:.3g} training FLOPs per token (6·N + 12·L·d·T), {_pct(gain)} less")  # fmt: skip
        basis = "FLOPs arithmetic"
    else:
        pad_now, pad_new = d.padding_to(s.max_len), d.padding_to(target)
        if s.batching == "pad" and pad_now and pad_new:
            w0, w1 = float(pad_now["padding_fraction"]), float(pad_new["padding_fraction"])
            gain = 1 - (1 - w0) / (1 - w1) if w1 < 1 else 0.0
            ev["padding_fraction"] = {str(s.max_len): w0, str(target): w1}
            effect = (f"padding to {target} instead of {s.max_len}: padding {_pct(w0)} -> {_pct(w1)}, "
                      f"{_pct(gain)} fewer positions computed")  # fmt: skip
            basis = "computed from the data"
        elif s.batching == "dynamic":
            gain = 0.0
            longest = (d.stats.get("document_length") or {}).get("max")
            effect = ("batches are padded to their longest row, not to the max length, so a lower "
                      "max length saves nothing for rows shorter than it"
                      + (f" (the longest document has {longest} tokens)" if longest else "")
                      + "; it only caps the rare long rows (memory) and cuts them (which changes "
                      "what is learned)")  # fmt: skip
            basis = "computed from the data"
        else:
            gain = 0.0
            effect = ("activation memory and attention cost per row grow with the row length; "
                      "a shorter max length frees memory for larger micro-batches")  # fmt: skip
            basis = "FLOPs arithmetic"
    key = s.max_len_key
    return Finding(
        id="max-len-above-p99",
        severity="medium"
        if gain >= 0.05 or (basis != "FLOPs arithmetic" and s.batching != "dynamic")
        else "low",
        title=f"max length {s.max_len} is {s.max_len / d.p99:.1f}x the data's p99 ({d.p99} tokens)",
        evidence=ev,
        effect=effect + f"; 99% of documents still fit whole in {target}",
        basis=basis,
        fix=s.fix(f"--max-seq-len {target}", f"{key}={target} (SFTConfig)"),
        gain=gain,
    )


@rule("truncation")
def truncation(ctx: Context) -> Finding | None:
    """Where documents are cut at the max length: TRL's SFTConfig (without packing), or
    pitstop's --long-docs truncate. pitstop's default splits long documents (no token lost)."""
    s, d = ctx.setup, ctx.data
    if d is None or not s.max_len:
        return None
    if s.source == "hf":
        cuts = s.hf_class == "SFTConfig" and s.batching != "pack"
    else:
        cuts = s.raw.get("long_docs") in ("truncate", "drop")
    share = d.truncated_share(s.max_len) if cuts else None
    if share is None or share < TRUNCATION_LIMIT:
        return None
    longest = int(np.max(d.doc_lengths)) if d.doc_lengths is not None else None
    return Finding(
        id="truncation",
        severity="medium" if share >= 0.05 else "low",
        title=f"{_pct(share)} of the data's tokens lie beyond max length {s.max_len} and are never trained",
        evidence={"truncated_token_share": round(share, 4), "max_len": s.max_len,
                  "longest_document": longest, "p99": d.p99},
        effect="a cut document loses its tail: fewer tokens learned per epoch than the data holds "
        "(this changes what is learned; it is not a speed-up)",
        basis="computed from the data",
        fix=s.fix("--long-docs split (the default: long documents become several rows, no token lost)",
                  f"a larger {s.max_len_key} (the longest document has {longest} tokens), or split "
                  "long documents into chunks of max length before training"),
        gain=0.0,
    )  # fmt: skip


# --- memory and recomputation --------------------------------------------------------------


# The rank a LoRA setup is priced at when it does not say its rank (peft's examples' 16).
DEFAULT_LORA_R = 16


def micro_batch_tokens(ctx: Context) -> int | None:
    s = ctx.setup
    if s.tokens_per_micro_batch:
        return s.tokens_per_micro_batch
    length = s.max_len or (ctx.data.p99 if ctx.data else None)
    if s.micro_batch_rows and length:
        return s.micro_batch_rows * length
    return None


def lora_rank(ctx: Context) -> int | None:
    """The LoRA rank the cost model prices (DEFAULT_LORA_R when a LoRA setup omits it)."""
    return (ctx.setup.lora_r or DEFAULT_LORA_R) if ctx.setup.lora else None


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


# --- precision and kernels -----------------------------------------------------------------


@rule("fp16-on-bf16-gpu")
def fp16_on_bf16(ctx: Context) -> Finding | None:
    if ctx.precision != "fp16" or not ctx.cuda or not ctx.device.bf16:
        return None
    return Finding(
        id="fp16-on-bf16-gpu",
        severity="medium",
        title=f"fp16 on {ctx.device.name}, which supports bf16",
        evidence={"precision": "fp16", "device": ctx.device.name, "bf16_supported": True},
        effect="same tensor-core peak (bf16 = fp16 on the datasheet), but bf16 has fp32's exponent "
        "range: no loss scaling, no steps skipped on overflow, no GradScaler inf check per step",
        basis="documented",
        reference="NVIDIA datasheets (pitstop/measure/peak.py GPU_PEAKS)",
        fix=ctx.setup.fix("--precision bf16 (or auto)", "bf16=True, fp16=False"),
    )


@rule("fp32-on-gpu")
def fp32_on_gpu(ctx: Context) -> Finding | None:
    if ctx.precision != "fp32" or not ctx.cuda:
        return None
    half = "bf16" if ctx.device.bf16 else "fp16"
    tf32_on = bool((ctx.env.get("tf32") or {}).get("matmul_allow_tf32")) or bool(ctx.setup.tf32)
    hi, _ = gpu_peak(ctx.device.name, half)
    lo, _ = gpu_peak(ctx.device.name, "tf32" if tf32_on else "fp32")
    ev: dict[str, Any] = {"precision": "fp32", "device": ctx.device.name}
    gain = 0.0
    if hi and lo:
        r = hi / lo
        ev["datasheet_peak_ratio"] = round(r, 2)
        compute = sum(ctx.shares.get(p, 0.0) for p in COMPUTE_PHASES) if ctx.profile else 1.0
        gain = (1 - 1 / r) * compute
        effect = (f"{half} tensor-core peak is {r:.1f}x the {'TF32' if tf32_on else 'fp32'} peak on "
                  f"this GPU (datasheet); matmul time falls by up to that factor, the rest of the step "
                  f"does not, and activations take half the memory")  # fmt: skip
    else:
        effect = f"{half} autocast runs matmuls on tensor cores and halves activation memory"
    return Finding(
        id="fp32-on-gpu",
        severity="high",
        title=f"training in fp32 on a GPU ({ctx.device.name})",
        evidence=ev,
        effect=effect,
        basis="documented",
        reference="NVIDIA datasheets (pitstop/measure/peak.py GPU_PEAKS)",
        fix=ctx.setup.fix(f"--precision {half} (or auto)", f"{half}=True"),
        gain=gain,
    )


@rule("flash-attn-missing")
def flash_attn_missing(ctx: Context) -> Finding | None:
    dev = ctx.device
    if not ctx.cuda or dev.capability is None or tuple(dev.capability) < (8, 0):
        return None
    if ctx.precision not in ("bf16", "fp16"):
        return None  # flash-attn has no fp32 kernels; fp32-on-gpu comes first
    fa = ctx.env.get("flash_attn") or {}
    if fa.get("installed"):
        return None
    ev: dict[str, Any] = {
        "device": dev.name,
        "capability": list(dev.capability),
        "flash_attn": None,
    }
    if ctx.model is not None and ctx.setup.max_len:
        m, T = ctx.model, ctx.setup.max_len
        ev["attention_flops_share"] = round(
            12 * m.n_layers * m.d_model * T / m.flops(lora_rank(ctx)).per_token(T), 4
        )
    packed = ctx.setup.batching == "pack"
    return Finding(
        id="flash-attn-missing",
        severity="medium" if packed else "low",
        title=f"flash-attn is not installed; {dev.name} (compute capability {dev.capability[0]}.{dev.capability[1]}) supports it",
        evidence=ev,
        effect=("packed rows then attend within each document only (varlen kernels): no "
                "block-diagonal mask, no cross-document work" if packed else
                "PyTorch SDPA already uses a flash kernel for unpadded causal batches; flash-attn's "
                "gain is mostly for padded and packed (varlen) batches"),
        basis="documented",
        reference="https://github.com/Dao-AILab/flash-attention",
        fix=ctx.setup.fix(
            "pip install flash-attn --no-build-isolation; --attention auto then uses it",
            "pip install flash-attn --no-build-isolation; load the model with "
            "attn_implementation='flash_attention_2' (SFTConfig: model_init_kwargs={'attn_implementation': 'flash_attention_2'})",
        ),
        gain=0.0,
    )  # fmt: skip


@rule("optimizer-not-fused", sources=("hf",))
def optimizer_not_fused(ctx: Context) -> Finding | None:
    """pitstop always uses fused AdamW on CUDA (probe.choose_optimizer): HF only."""
    opt = (ctx.setup.optimizer or "").lower()
    if (
        not ctx.cuda
        or opt in ("adamw_torch_fused", "adamw_apex_fused")
        or "8bit" in opt
        or "adamw" not in opt
    ):
        return None
    share = ctx.shares.get("optimizer")
    lora = ctx.setup.lora
    return Finding(
        id="optimizer-not-fused",
        severity="medium" if share is not None and share >= 0.1 else "low",
        title=f"optimizer {opt!r} is not the fused AdamW",
        evidence={"optim": opt, "optimizer_share": None if share is None else round(share, 4),
                  "trained": "LoRA adapters only" if lora else "all parameters"},
        effect="the fused implementation updates all parameters in one kernel instead of several "
        "kernels per tensor" + (f"; the optimizer step is {_pct(share)} of step time here, the most this can save"
                                if share is not None else "")
        + ("; with LoRA only the adapters are optimised (many small tensors, few bytes), so the "
           "saving is per-kernel launch overhead, small next to forward and backward" if lora else ""),
        basis="measured in this profile" if share is not None else "documented",
        reference="https://pytorch.org/docs/stable/generated/torch.optim.AdamW.html (fused)",
        fix='optim="adamw_torch_fused"',
        gain=(share or 0.0) * 0.5,
    )  # fmt: skip


@rule("compile-off")
def compile_off(ctx: Context) -> Finding | None:
    if not ctx.cuda or ctx.setup.compile != "off":
        return None

    works = (ctx.env.get("compile") or {}).get("works")
    return Finding(
        id="compile-off",
        severity="low",
        title="torch.compile is off",
        evidence={"compile": "off", "compile_works_here": works},
        effect="compile fuses elementwise kernels; the gain is not known in advance: pitstop's own "
        f"measurement was {COMPILE_GAIN_BASIS:.2f}x faster steps after a {COMPILE_SECONDS_BASIS:.0f} s "
        "compile (CPU, tiny Llama), so it pays only on long runs; `pitstop tune` measures it on yours",
        basis="documented",
        reference="pitstop/probe.py (COMPILE_GAIN_BASIS, COMPILE_SECONDS_BASIS)",
        fix=ctx.setup.fix("--compile auto (compiles when the run is long enough to repay it)",
                          "torch_compile=True"),
    )  # fmt: skip


# --- periodic work: checkpoints, logging, evaluation ---------------------------------------


def _periodic(
    ctx: Context, phase: str, event: str, every: int | None
) -> tuple[float, float, int | None, float] | None:
    """(share of the run, seconds per event, every, base step seconds) from the profile."""
    if not ctx.profile:
        return None
    secs = float((ctx.profile.get("phases") or {}).get(phase, 0.0))
    if secs <= 0:
        return None
    n = (ctx.profile.get("events") or {}).get(event)
    base = ctx.base_step_seconds()
    share = ctx.shares.get(phase, 0.0)
    if n and base and every:
        per = secs / n
        return per / (every * base + per), per, every, base
    return share, secs / n if n else secs, every, base or 0.0


def _every_for(per: float, base: float, target: float) -> int:
    """Smallest interval (in steps) that keeps a per-event cost under `target` of the run."""
    raw = per * (1 - target) / (target * base) if base > 0 else 1000
    n = max(1, math.ceil(raw))
    mag = 10 ** max(0, len(str(n)) - 2)  # round up to 2 significant digits
    return math.ceil(n / mag) * mag


@rule("checkpoint-overhead")
def checkpoint_overhead(ctx: Context) -> Finding | None:
    got = _periodic(ctx, "checkpoint", "checkpoints", ctx.setup.save_steps)
    if got is None or got[0] <= CHECKPOINT_LIMIT:
        return None
    share, per, every, base = got
    n = _every_for(per, base, PERIODIC_TARGET) if base else None
    return Finding(
        id="checkpoint-overhead",
        severity="high" if share >= CHECKPOINT_SEVERE else "medium",
        title=f"checkpointing costs {_pct(share)} of the run",
        evidence={"seconds_per_checkpoint": round(per, 4), "save_steps": every,
                  "step_seconds_without_periodic": round(base, 6), "share": round(share, 4)},
        effect=f"saving every {n} steps would cost about {_pct(PERIODIC_TARGET)}" if n else
        "fewer saves cost proportionally less",
        basis="measured in this profile",
        fix=ctx.setup.fix(f"--save-steps {n} (or --save-minutes M)" if n else "--save-minutes 30",
                          f"save_steps={n}" if n else 'save_strategy="epoch"'),
        gain=share - PERIODIC_TARGET,
    )  # fmt: skip


@rule("logging-overhead")
def logging_overhead(ctx: Context) -> Finding | None:
    s = ctx.setup
    got = _periodic(ctx, "logging", "logs", s.log_steps)
    if got is None:
        if s.source == "hf" and s.log_steps == 1 and not ctx.profile:
            return Finding(
                id="logging-overhead",
                severity="low",
                title="logging every step (cost not measured: no profile)",
                evidence={"logging_steps": 1},
                effect="each log reads the loss back from the device (a host-device sync) and runs "
                "every reporting callback; measure the cost with pitstop.hf.PitstopCallback",
                basis="documented",
                reference="transformers Trainer._maybe_log_save_evaluate",
                fix="logging_steps=10",
            )
        return None
    share, per, every, base = got
    if share <= LOGGING_LIMIT:
        return None
    n = _every_for(per, base, PERIODIC_TARGET / 2) if base else None
    return Finding(
        id="logging-overhead",
        severity="medium" if share >= 0.05 else "low",
        title=f"logging costs {_pct(share)} of the run",
        evidence={"seconds_per_log": round(per, 6), "log_steps": every, "share": round(share, 4)},
        effect=f"logging every {n} steps would cost under {_pct(PERIODIC_TARGET / 2)}" if n else "log less often",
        basis="measured in this profile",
        fix=s.fix(f"--log-steps {n or 50}", f"logging_steps={n or 50}"),
        gain=share,
    )  # fmt: skip


@rule("eval-overhead")
def eval_overhead(ctx: Context) -> Finding | None:
    got = _periodic(ctx, "eval", "evals", ctx.setup.eval_steps)
    if got is None or got[0] <= EVAL_LIMIT:
        return None
    share, per, every, base = got
    n = _every_for(per, base, PERIODIC_TARGET) if base else None
    return Finding(
        id="eval-overhead",
        severity="medium" if share >= 0.05 else "low",
        title=f"evaluation costs {_pct(share)} of the run",
        evidence={"seconds_per_eval": round(per, 4), "eval_steps": every, "share": round(share, 4)},
        effect=(f"evaluating every {n} steps would cost about {_pct(PERIODIC_TARGET)}; "
                "or evaluate on a smaller held-out set") if n else "evaluate less often or on less data",
        basis="measured in this profile",
        fix=ctx.setup.fix(f"--eval-steps {n or 500}", f"eval_steps={n or 500}"),
        gain=share - PERIODIC_TARGET,
    )  # fmt: skip


# --- other verdicts from the profile -------------------------------------------------------


@rule("optimizer-bound")
def optimizer_bound(ctx: Context) -> Finding | None:
    share = ctx.shares.get("optimizer", 0.0)
    if not ctx.profile or share < OPTIMIZER_MODERATE:
        return None
    s = ctx.setup
    caveat = ("more tokens per optimizer step amortise the update, but that changes the effective "
              "batch (rows per device x accumulation x processes) and with it the training math: "
              "retune the learning rate; it is not a free speed-up")  # fmt: skip
    return Finding(
        id="optimizer-bound",
        severity="high" if share >= OPTIMIZER_SEVERE else "medium",
        title=f"the optimizer step takes {_pct(share)} of step time",
        evidence={"optimizer_share": round(share, 4), "tokens_per_step": ctx.profile.get("tokens_per_step"),
                  "optim": s.optimizer},
        effect="AdamW reads and writes ~16 bytes per parameter per step whatever the batch; " + caveat,
        basis="measured in this profile",
        fix=s.fix("--tokens-per-step T (larger T: changes the training math, see effect)",
                  'optim="adamw_torch_fused"; or a larger gradient_accumulation_steps (changes the effective batch, see effect)'),
        gain=share / 2,
    )  # fmt: skip


BUSY_LOAD_PER_CORE = BUSY_LOAD_PER_CORE


def _noisy(ctx: Context) -> dict[str, Any] | None:
    """The verdict's noisy-machine evidence: erratic steps that host time does not explain,
    or a machine whose load exceeded its cores (pitstop.measure.verdict decides it)."""
    v = ctx.verdict
    found = [x for x in ([v, *v.also] if v else []) if x.kind == "noisy-machine"]
    if not found:
        return None
    ev = found[0].evidence
    return {"step_spread": ev["step_spread"], "host_share": ev["host_share"],
            "load_average_1m": ev.get("load_average_1m"), "cpu_cores": ev.get("cpu_cores"),
            "busy": ev["busy"], "shared": ev.get("shared"), "erratic": ev.get("erratic", True),
            "share": found[0].share}  # fmt: skip


@rule("noisy-machine")
def noisy_machine(ctx: Context) -> Finding | None:
    got = _noisy(ctx)
    if got is None:
        return None
    sp = got["step_spread"]
    why = got["shared"] or (
        f"load average {got['load_average_1m']:.1f} on {got['cpu_cores']} cores"
        if got["busy"]
        else f"host-side time (other + logging) is only {_pct(got['host_share'])} of the step"
    )
    erratic = got["erratic"] and sp is not None
    steps = (
        f"steps vary (coefficient of variation {sp['cv']:.2f}, slowest {sp['max_over_median']:.1f}x "
        f"the median) while {why}"
        if erratic
        else f"steps were steady, but {why} while they ran"
    )
    return Finding(
        id="noisy-machine",
        severity="medium",
        title="step times are erratic: the machine is noisy or shared"
        if erratic
        else "the machine was shared while this profile was measured",
        evidence=got,
        effect=f"{steps}: another process competes for the CPU or device. Measured "
        "speed-ups and estimates from this profile carry that noise; the steady (median) step is "
        "the better figure",
        basis="measured in this profile",
        fix="measure on a quiet machine (no other training, tokenization or builds running), "
        "or pin the run to its own cores; no configuration change follows from this profile",
        gain=0.0,
    )


@rule("sync-bound")
def sync_bound(ctx: Context) -> Finding | None:
    """Stays quiet where noisy-machine explains the erratic steps (no sync advice then)."""
    noisy = _noisy(ctx)
    if not ctx.profile or (noisy is not None and noisy["erratic"]):
        return None
    v = ctx.verdict
    found = [x for x in ([v, *v.also] if v else []) if x.kind == "sync-bound"]
    if not found:
        return None
    x = found[0]
    s = ctx.setup
    hf_fix = "logging_steps=50; remove per-step .item()/print calls from callbacks"
    if not ctx.cuda:  # no device to synchronise with: Python work between steps is the cost
        return Finding(
            id="sync-bound",
            severity="high" if x.severity == "severe" else "medium",
            title="host-side time between steps: Python overhead, logging or allocator stalls",
            evidence={k: x.evidence.get(k) for k in ("other_share", "logging_share", "step_spread")},
            effect=x.summary + f"; up to {_pct(x.share)} of step time is at stake",
            basis="measured in this profile",
            fix=s.fix("--log-steps 50; look for per-step Python work (printing, .item(), "
                      "tokenizing) in custom code", hf_fix),
            gain=x.share,
        )  # fmt: skip
    if ctx.cuda and s.nan_inf_filter:
        hf_fix = ("logging_nan_inf_filter=False (the default True tests every micro-batch's loss "
                  "for NaN on the host, a device sync per micro-batch); " + hf_fix)  # fmt: skip
    return Finding(
        id="sync-bound",
        severity="high" if x.severity == "severe" else "medium",
        title="host-side time or erratic steps: the device waits on the host",
        evidence={k: x.evidence.get(k) for k in ("other_share", "logging_share", "step_spread")},
        effect=x.summary + f"; up to {_pct(x.share)} of step time is at stake",
        basis="measured in this profile",
        fix=s.fix("--log-steps 50 (pitstop syncs only at logging steps); look for .item() or "
                  "torch.cuda.empty_cache() calls in custom code", hf_fix),
        gain=x.share,
    )  # fmt: skip


# --- correctness and folklore --------------------------------------------------------------


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
        fix=s.fix("remove torch.cuda.empty_cache() calls from custom code",
                  "torch_empty_cache_steps=None (remove it)"),
        gain=0.05,
    )  # fmt: skip


@rule("effective-batch-changed")
def effective_batch_changed(ctx: Context) -> Finding | None:
    b = ctx.baseline
    if b is None:
        return None
    # Units that match the batching: HF batches padded per batch (or bucketed) hold a fixed
    # number of rows whose length varies, so rows x max length counts no real quantity.
    rows_batched = ctx.setup.source == "hf" and ctx.setup.batching != "pack"
    old, new = b.effective_tokens_per_step, ctx.setup.effective_tokens_per_step
    unit = "positions"
    if rows_batched or old is None or new is None:
        old, new, unit = b.rows_per_step, ctx.setup.rows_per_step, "rows"
    if old is None or new is None or old == new:
        return None
    s = ctx.setup
    return Finding(
        id="effective-batch-changed",
        severity="high",
        title=f"the effective batch changed: {old} -> {new} {unit} per optimizer step",
        evidence={"baseline": old, "this": new, "unit": unit,
                  "rows_per_device": s.micro_batch_rows, "accumulation": s.grad_accum, "processes": s.world},
        effect="per-device batch x accumulation x processes sets the gradient noise and the number "
        "of optimizer steps; changing it changes what is learned, so a faster step is not a free "
        "speed-up (compare runs at equal tokens per optimizer step)",
        basis="FLOPs arithmetic",
        fix=s.fix(f"--tokens-per-step {old}" if unit == "positions" else "keep --micro-batch-size x --grad-accum x --nproc equal to the baseline",
                  f"per_device_train_batch_size x gradient_accumulation_steps x world size = {old} {unit} (as in the baseline)"),
    )  # fmt: skip


def run_rules(ctx: Context) -> list[Finding]:
    out = []
    for _, sources, fn in RULES:
        if ctx.setup.source in sources:
            f = fn(ctx)
            if f is not None:
                out.append(f)
    return out
