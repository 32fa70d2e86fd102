"""Rules that read the profile's other verdicts: optimizer-bound, a noisy machine, sync-bound."""

from __future__ import annotations

from typing import TypedDict

from pitstop.advise.finding import Finding
from pitstop.advise.rules.context import Context, pct, rule
from pitstop.measure.verdict import BUSY_LOAD_PER_CORE, OPTIMIZER_MODERATE, OPTIMIZER_SEVERE


@rule("optimizer-bound")
def optimizer_bound(ctx: Context) -> Finding | None:
    share = ctx.shares.get("optimizer", 0.0)
    if not ctx.profile or share < OPTIMIZER_MODERATE:
        return None
    s = ctx.setup
    caveat = (
        "more tokens per optimizer step amortise the update, but that changes the effective "
        "batch (rows per device x accumulation x processes) and with it the training math: "
        "retune the learning rate; it is not a free speed-up"
    )
    return Finding(
        id="optimizer-bound",
        severity="high" if share >= OPTIMIZER_SEVERE else "medium",
        title=f"the optimizer step takes {pct(share)} of step time",
        evidence={
            "optimizer_share": round(share, 4),
            "tokens_per_step": ctx.profile.get("tokens_per_step"),
            "optim": s.optimizer,
        },
        effect=f"AdamW reads and writes ~16 bytes per parameter per step whatever the batch; {caveat}",
        basis="measured in this profile",
        fix=s.fix(
            "--tokens-per-step T (larger T: changes the training math, see effect)",
            'optim="adamw_torch_fused"; or a larger gradient_accumulation_steps (changes the effective batch, see effect)',
            "torch.optim.AdamW(params, lr=..., fused=True) on a GPU; or accumulate more "
            "micro-batches per optimizer.step() (changes the effective batch, see effect)",
        ),
        gain=share / 2,
    )


BUSY_LOAD_PER_CORE = BUSY_LOAD_PER_CORE


class NoisyEvidence(TypedDict):
    """The noisy-machine verdict's evidence as the rule reports it."""

    step_spread: dict[str, float] | None  # cv, max_over_median, excess_share
    host_share: float
    load_average_1m: float | None
    cpu_cores: int | None
    busy: bool
    shared: str | None  # "other processes used 1.0 of 2 cores" (measure.machine)
    erratic: bool
    share: float


def _noisy(ctx: Context) -> NoisyEvidence | None:
    """The verdict's noisy-machine evidence: erratic steps that host time does not explain,
    or a machine whose load exceeded its cores (pitstop.measure.verdict decides it)."""
    v = ctx.verdict
    found = [x for x in ([v, *v.also] if v else []) if x.kind == "noisy-machine"]
    if not found:
        return None
    ev = found[0].evidence
    return NoisyEvidence(
        step_spread=ev["step_spread"],
        host_share=ev["host_share"],
        load_average_1m=ev.get("load_average_1m"),
        cpu_cores=ev.get("cpu_cores"),
        busy=ev["busy"],
        shared=ev.get("shared"),
        erratic=ev.get("erratic", True),
        share=found[0].share,
    )


@rule("noisy-machine")
def noisy_machine(ctx: Context) -> Finding | None:
    got = _noisy(ctx)
    if got is None:
        return None
    sp = got["step_spread"]
    why = got["shared"] or (
        f"load average {got['load_average_1m']:.1f} on {got['cpu_cores']} cores"
        if got["busy"]
        else f"host-side time (other + logging) is only {pct(got['host_share'])} of the step"
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


def _logging_measured(ctx: Context) -> bool:
    p = ctx.profile or {}
    logs = (p.get("events") or {}).get("logs")
    return bool(logs) or ctx.shares.get("logging", 0.0) > 0 or ctx.setup.source == "pitstop"


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
    # "Log less" only where logging was measured (a Trainer's on_log, pitstop's log steps):
    # a plain loop's prints are not timed, so its host time is not known to be logging.
    logged = _logging_measured(ctx)
    hf_fix = (
        "logging_steps=50; remove per-step .item()/print calls from callbacks"
        if logged
        else "remove per-step .item()/print calls from callbacks"
    )
    if not ctx.cuda:  # no device to synchronise with: Python work between steps is the cost
        title = "host-side time between steps: Python overhead" + (
            ", logging or allocator stalls" if logged else " or allocator stalls"
        )
        fix = s.fix(
            "--log-steps 50; look for per-step Python work (printing, .item(), "
            "tokenizing) in custom code",
            hf_fix,
            "find the per-step Python work between optimizer.step() and the next forward "
            "(printing, .item(), tokenizing, building tensors) and move it out of the loop, "
            "or do it every N steps",
        )
    else:
        if s.nan_inf_filter:
            hf_fix = (
                "logging_nan_inf_filter=False (the default True tests every micro-batch's "
                "loss for NaN on the host, a device sync per micro-batch); " + hf_fix
            )
        title = "host-side time or erratic steps: the device waits on the host"
        fix = s.fix(
            "--log-steps 50 (pitstop syncs only at logging steps); look for .item() or "
            "torch.cuda.empty_cache() calls in custom code",
            hf_fix,
            "read loss.item() only every 50 steps (each .item() waits for the GPU); "
            "remove torch.cuda.empty_cache() and per-step prints from the loop",
        )
    return Finding(
        id="sync-bound",
        severity="high" if x.severity == "severe" else "medium",
        title=title,
        evidence={k: x.evidence.get(k) for k in ("other_share", "logging_share", "step_spread")},
        effect=x.summary + f"; up to {pct(x.share)} of step time is at stake",
        basis="measured in this profile",
        fix=fix,
        gain=x.share,
    )
