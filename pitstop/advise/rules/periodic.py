"""Rules about periodic work: checkpoints, logging, evaluation, and the gc.collect() /
torch.cuda.empty_cache() calls a custom loop makes (timed by pitstop.anyloop.timer.Watch)."""

from __future__ import annotations

import math

from pitstop.advise.finding import Finding
from pitstop.advise.rules.context import Context, pct, rule
from pitstop.measure.verdict import CHECKPOINT_SEVERE, EVAL_SEVERE

# A fix should bring a periodic cost under this share of the run (pitstop's target).
PERIODIC_TARGET = 0.01
CHECKPOINT_LIMIT, LOGGING_LIMIT, EVAL_LIMIT = 0.02, 0.01, 0.01
# gc.collect() / empty_cache() pauses above this share of the run are worth removing.
MEMORY_CALLS_LIMIT = 0.01
# The profile phases and event counts pitstop.anyloop.timer.Watch records for these calls.
MEMORY_CALLS = {
    "gc.collect()": ("gc_collect", "gc_collects"),
    "torch.cuda.empty_cache()": ("empty_cache", "empty_cache_calls"),
}


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
    effect = "fewer saves cost proportionally less"
    if n:
        effect = f"saving every {n} steps would cost about {pct(PERIODIC_TARGET)}"
    return Finding(
        id="checkpoint-overhead",
        severity="high" if share >= CHECKPOINT_SEVERE else "medium",
        title=f"checkpointing costs {pct(share)} of the run",
        evidence={
            "seconds_per_checkpoint": round(per, 4),
            "save_steps": every,
            "step_seconds_without_periodic": round(base, 6),
            "share": round(share, 4),
        },
        effect=effect,
        basis="measured in this profile",
        fix=ctx.setup.fix(
            f"--save-steps {n} (or --save-minutes M)" if n else "--save-minutes 30",
            f"save_steps={n}" if n else 'save_strategy="epoch"',
            f"call torch.save every {n} steps" if n else "save less often (once an epoch)",
        ),
        gain=share - PERIODIC_TARGET,
    )


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
    effect = "log less often"
    if n:
        effect = f"logging every {n} steps would cost under {pct(PERIODIC_TARGET / 2)}"
    return Finding(
        id="logging-overhead",
        severity="medium" if share >= 0.05 else "low",
        title=f"logging costs {pct(share)} of the run",
        evidence={"seconds_per_log": round(per, 6), "log_steps": every, "share": round(share, 4)},
        effect=effect,
        basis="measured in this profile",
        fix=s.fix(f"--log-steps {n or 50}", f"logging_steps={n or 50}"),
        gain=share,
    )


@rule("eval-overhead")
def eval_overhead(ctx: Context) -> Finding | None:
    s = ctx.setup
    got = _periodic(ctx, "eval", "evals", s.eval_steps)
    if got is None or got[0] <= EVAL_LIMIT:
        return None
    # The share of a run that evaluates every `every` steps (one evaluation per interval);
    # the profiled steps' own share (what the verdict reads) is in the evidence.
    share, per, every, base = got
    measured = ctx.shares.get("eval", 0.0)
    events = (ctx.profile or {}).get("events") or {}
    evals, forwards = events.get("evals"), events.get("eval_forwards")
    per_eval = round(forwards / evals) if evals and forwards else None
    how = ", ".join(
        x
        for x in (
            f"{per_eval} forward passes" if per_eval else None,
            f"every {every} steps" if every else None,
        )
        if x
    )
    n = _every_for(per, base, PERIODIC_TARGET) if base else None
    effect = "evaluate less often or on less data"
    if n:
        effect = (
            f"evaluating every {n} steps would cost about {pct(PERIODIC_TARGET)}; "
            "or evaluate on fewer batches"
        )
    return Finding(
        id="eval-overhead",
        severity="high" if share >= EVAL_SEVERE else "medium" if share >= 0.05 else "low",
        title=f"evaluation takes {pct(share)} of the run" + (f": {how}" if how else ""),
        evidence={
            "seconds_per_eval": round(per, 4),
            "eval_steps": every,
            "evals": evals,
            "eval_forwards": forwards,
            "share": round(share, 4),
            "profiled_share": round(measured, 4),
        },
        effect=effect + " (the training math is unchanged: evaluation only reads the model)",
        basis="measured in this profile",
        fix=s.fix(
            f"--eval-steps {n or 500}",
            f"eval_steps={n or 500}; or a smaller eval_dataset (fewer rows per evaluation), "
            "and eval_accumulation_steps if predictions are gathered",
            f"evaluate every {n or 500} steps instead of every {every or 'few'} (nanoGPT's "
            "eval_interval), or on fewer batches (eval_iters)",
            f"L.Trainer(val_check_interval={n or 500}, limit_val_batches=...): validate less "
            "often, or on fewer batches",
        ),
        gain=share - PERIODIC_TARGET,
    )


@rule("gc-empty-cache-pauses", sources=("hf",))
def gc_empty_cache_pauses(ctx: Context) -> Finding | None:
    """Measured gc.collect() / torch.cuda.empty_cache() calls of a custom loop (timed by
    pitstop.watch, whose runs the doctor reads as source hf); `pitstop train` makes neither
    call, and a Trainer's torch_empty_cache_steps is the `empty-cache` rule's."""
    if not ctx.profile:
        return None
    phases, events = ctx.profile.get("phases") or {}, ctx.profile.get("events") or {}
    seen = {
        name: (float(phases.get(ph, 0.0)), int(events.get(ev) or 0))
        for name, (ph, ev) in MEMORY_CALLS.items()
    }
    calls = sum(n for _, n in seen.values())
    if not calls:
        return None
    seconds = sum(sec for sec, _ in seen.values())
    share = sum(ctx.shares.get(ph, 0.0) for ph, _ in MEMORY_CALLS.values())
    # On a GPU the call's own time is not its whole cost: the memory handed back is
    # allocated again, with synchronising cudaMalloc calls, in the steps after it.
    refill = ctx.cuda and seen["torch.cuda.empty_cache()"][1] > 0
    if share <= MEMORY_CALLS_LIMIT and not refill:
        return None
    steps = max(1, int(ctx.profile.get("steps") or 1))
    base = max((ctx.base_step_seconds() or 0.0) - seconds / steps, 0.0)
    per = seconds / calls
    n = _every_for(per, base, PERIODIC_TARGET) if base and per else None
    names = [name for name, (_, k) in seen.items() if k]
    ev: dict[str, object] = {}
    for name, (ph, _) in MEMORY_CALLS.items():
        sec, k = seen[name]
        ev[f"{ph}_calls"], ev[f"{ph}_seconds"] = k, round(sec, 6)
    ev.update(steps=steps, share=round(share, 4))
    effect = f"the calls take {pct(share)} of step time ({per:.4f} s per call, {calls} calls in {steps} steps)"
    if refill:
        effect += (
            "; each empty_cache() also hands cached memory back to the driver, so the next "
            "steps allocate it again with synchronising cudaMalloc calls (not in this figure)"
        )
    fix = f"remove the {' and '.join(names)} calls from the training loop"
    if n:
        fix += f" (or call them every {n} steps: about {pct(PERIODIC_TARGET)} of the run)"
    if refill:
        fix += "; against fragmentation OOMs set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    return Finding(
        id="gc-empty-cache-pauses",
        severity="medium" if share >= 0.05 else "low",
        title=f"{' and '.join(names)} pauses take {pct(share)} of the run",
        evidence=ev,
        effect=effect + ("" if share > MEMORY_CALLS_LIMIT else "; the pause itself is small"),
        basis="measured in this profile",
        reference="https://docs.python.org/3/library/gc.html; https://pytorch.org/docs/stable/notes/cuda.html#memory-management",
        fix=fix,
        gain=share,
    )
