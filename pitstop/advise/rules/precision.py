"""Rules about precision and kernels: fp16/fp32/TF32, flash attention, fused optimizers, torch.compile."""

from __future__ import annotations

from typing import Any

from pitstop.advise.finding import Finding
from pitstop.advise.rules.context import Context, lora_rank, pct, rule
from pitstop.measure.peak import gpu_peak
from pitstop.measure.verdict import COMPUTE_PHASES
from pitstop.probe import COMPILE_GAIN_BASIS, COMPILE_SECONDS_BASIS, CPU_BF16_MIN_GAIN


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
        reference="NVIDIA datasheets (pitstop/catalog/gpus.py)",
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
        effect = (
            f"{half} tensor-core peak is {r:.1f}x the {'TF32' if tf32_on else 'fp32'} peak on "
            f"this GPU (datasheet); matmul time falls by up to that factor, the rest of the step "
            f"does not, and activations take half the memory"
        )
    else:
        effect = f"{half} autocast runs matmuls on tensor cores and halves activation memory"
    return Finding(
        id="fp32-on-gpu",
        severity="high",
        title=f"training in fp32 on a GPU ({ctx.device.name})",
        evidence=ev,
        effect=effect,
        basis="documented",
        reference="NVIDIA datasheets (pitstop/catalog/gpus.py)",
        fix=ctx.setup.fix(f"--precision {half} (or auto)", f"{half}=True"),
        gain=gain,
    )


@rule("fp32-on-bf16-cpu")
def fp32_on_bf16_cpu(ctx: Context) -> Finding | None:
    """A run in fp32 on a CPU with native bf16: what bf16 autocast would give it, from the
    measurement `pitstop train --precision auto` decides with (fp32 against bf16 autocast
    at the model's matmul shapes, pitstop.measure.peak), taken for the run's own model."""
    dev = ctx.device
    if ctx.cuda or dev.type != "cpu" or not dev.bf16 or ctx.precision != "fp32":
        return None
    m = ctx.measured_precision
    s = ctx.setup
    fix = s.fix(
        "--precision auto (or bf16)",
        "bf16=True (bf16 autocast on the CPU; fp32 master weights and optimizer state)",
        "wrap the forward and the loss in `with torch.autocast('cpu', dtype=torch.bfloat16):` "
        "(fp32 weights and optimizer state stay)",
        "L.Trainer(precision='bf16-mixed')",
    )
    ev = {"precision": "fp32", "device": dev.name, "bf16_native": True}
    if m is None:
        return Finding(
            id="fp32-on-bf16-cpu",
            severity="low",
            title="training in fp32 on a CPU with native bf16 (its speed here not measured)",
            evidence=ev,
            effect="bf16 autocast runs the matmuls in bf16 where the CPU computes it natively; "
            "whether it is faster depends on the model's shapes",
            basis="documented",
            reference="pitstop/probe.py (CPU_BF16_FLAGS)",
            fix=fix + "; `pitstop tune --` measures it on the script",
        )
    ev.update(m.to_dict())
    compute = sum(ctx.shares.get(p, 0.0) for p in COMPUTE_PHASES) if ctx.profile else 1.0
    faster = m.gain >= CPU_BF16_MIN_GAIN
    gain = (1 - 1 / m.gain) * compute if faster else 0.0
    effect = f"{m.describe()}; forward and backward are {pct(compute)} of the step"
    if faster:
        effect += f", so the step would take about {pct(gain)} less"
    else:
        effect += (
            f": below the {CPU_BF16_MIN_GAIN:.2f}x pitstop train asks before it switches, so "
            "keep fp32 here"
        )
    return Finding(
        id="fp32-on-bf16-cpu",
        severity=("high" if gain >= 0.3 else "medium") if faster else "low",
        title=f"training in fp32 on a CPU with native bf16: bf16 autocast measured {m.gain:.2f}x "
        "at this model's shapes",
        evidence=ev,
        effect=effect + " (same math up to precision: bf16 matmul inputs, fp32 accumulation)",
        basis="measured in this profile",
        fix=fix if faster else f"none: keep fp32 ({fix.split(' (')[0]} measured slower here)",
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
    packed = ctx.setup.packed
    if packed:
        effect = (
            "packed rows then attend within each document only (varlen kernels): no "
            "block-diagonal mask, no cross-document work"
        )
    else:
        effect = (
            "PyTorch SDPA already uses a flash kernel for unpadded causal batches; flash-attn's "
            "gain is mostly for padded and packed (varlen) batches"
        )
    return Finding(
        id="flash-attn-missing",
        severity="medium" if packed else "low",
        title=f"flash-attn is not installed; {dev.name} (compute capability {dev.capability[0]}.{dev.capability[1]}) supports it",
        evidence=ev,
        effect=effect,
        basis="documented",
        reference="https://github.com/Dao-AILab/flash-attention",
        fix=ctx.setup.fix(
            "pip install flash-attn --no-build-isolation; --attention auto then uses it",
            "pip install flash-attn --no-build-isolation; load the model with "
            "attn_implementation='flash_attention_2' (SFTConfig: model_init_kwargs={'attn_implementation': 'flash_attention_2'})",
        ),
        gain=0.0,
    )


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
    effect = (
        "the fused implementation updates all parameters in one kernel instead of several "
        "kernels per tensor"
    )
    if share is not None:
        effect += f"; the optimizer step is {pct(share)} of step time here, the most this can save"
    if lora:
        effect += (
            "; with LoRA only the adapters are optimised (many small tensors, few bytes), so the "
            "saving is per-kernel launch overhead, small next to forward and backward"
        )
    return Finding(
        id="optimizer-not-fused",
        severity="medium" if share is not None and share >= 0.1 else "low",
        title=f"optimizer {opt!r} is not the fused AdamW",
        evidence={
            "optim": opt,
            "optimizer_share": None if share is None else round(share, 4),
            "trained": "LoRA adapters only" if lora else "all parameters",
        },
        effect=effect,
        basis="measured in this profile" if share is not None else "documented",
        reference="https://pytorch.org/docs/stable/generated/torch.optim.AdamW.html (fused)",
        fix='optim="adamw_torch_fused"',
        gain=(share or 0.0) * 0.5,
    )


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
        effect="compile fuses elementwise kernels; the gain is not known in advance: pitstop's "
        f"basis is {COMPILE_GAIN_BASIS:.2f}x faster steps after a {COMPILE_SECONDS_BASIS:.0f} s "
        "compile (CPU, 7.6M-parameter Llama), so it pays only on long runs; a pitstop run that "
        "compiles measures it on yours, and `compile: auto` then decides with that",
        basis="documented",
        reference="pitstop/probe.py (COMPILE_GAIN_BASIS, COMPILE_SECONDS_BASIS)",
        fix=ctx.setup.fix(
            "--compile auto (compiles when the run is long enough to repay it)",
            "torch_compile=True",
        ),
    )
