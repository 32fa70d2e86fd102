"""Rules about feeding the device: input-bound steps, loader workers."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypedDict

from pitstop.advise.finding import Finding
from pitstop.advise.rules.context import Context, pct, rule
from pitstop.measure.verdict import INPUT_MODERATE, INPUT_SEVERE

# What a custom loop changes to load in worker processes (DataLoader's own arguments).
LOADING_DOCS = "https://pytorch.org/docs/stable/data.html#single-and-multi-process-data-loading"
LOOP_WORKERS = "DataLoader(..., num_workers={k}, pin_memory=True, persistent_workers=True)"
LOOP_TOKENIZE = (
    "tokenize/pre-process before training (run the tokenizer over the dataset once and keep "
    "the token ids; __getitem__ only indexes them), not in __getitem__ or collate_fn"
)
HF_TOKENIZE = (
    "tokenize/pre-process before training (dataset.map), not in __getitem__ or the collator"
)
PITSTOP_TOKENIZE = (
    "make each batch cheaper: a prepared token store on local disk, no per-batch tokenization"
)


def _suggest_workers(ctx: Context) -> int:
    # A pre-tokenized store needs little CPU per batch; a few workers keep the queue full,
    # and one core stays free for the training process itself. A target machine whose
    # cores are unknown (cpu_count 0, see advise/target.py) gets the cap.
    cores = ctx.device.cpu_count
    return 4 if cores <= 0 else max(1, min(4, cores - 1))


def _input_bound_workers(ctx: Context) -> int | None:
    """The worker count an input-bound run should try when the profile cannot size it: never
    fewer than it has (a run that waits for data with N workers is not helped by fewer).
    None when it already has every core it can use (the cores minus one for the training
    process)."""
    k = _suggest_workers(ctx)
    have = workers_in_use(ctx) or 0
    if k > have:
        return k
    cores = ctx.device.cpu_count
    room = 2 * have if cores <= 0 else min(2 * have, cores - 1)
    return room if room > have else None


def workers_in_use(ctx: Context) -> int | None:
    """The loader workers the profiled run had: the setup's, else the count pitstop chose
    (its profile's choices); None when neither says."""
    if ctx.setup.loader_workers is not None:
        return ctx.setup.loader_workers
    chosen = ((ctx.profile or {}).get("choices") or {}).get("loader_workers")
    value = chosen.get("value") if isinstance(chosen, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class LoadArithmetic:
    """How many loader workers would hide the measured loading, from the profile alone.

    Workers load batches in parallel with the step: with N workers the steady step is
    about max(compute, load / N), so the data wait per step is load / N - compute. With 0
    workers the wait is the whole load. Hence load per step = wait (N = 0) or
    N·(compute + wait), and the workers that hide it: ceil(load / compute).
    """

    load_s_per_step: float
    compute_s_per_step: float
    step_s: float  # the mean measured step: compute + wait
    workers_needed: int
    batches_per_step: int | None  # micro-batches fetched per optimizer step, when known

    @property
    def load_s_per_batch(self) -> float | None:
        return self.load_s_per_step / self.batches_per_step if self.batches_per_step else None


def load_arithmetic(ctx: Context) -> LoadArithmetic | None:
    """The profile's load and compute seconds per step; None without a profile, without the
    run's worker count, or when the step is all wait (no compute to overlap with)."""
    p = ctx.profile
    have = workers_in_use(ctx)
    if not p or have is None:
        return None
    steps = int(p.get("steps") or 0)
    phases = p.get("phases") or {}
    total = float(sum(p.get("step_seconds") or [])) or float(sum(phases.values()))
    if steps <= 0 or total <= 0:
        return None
    wait = float(phases.get("data_wait", 0.0)) / steps
    compute = total / steps - wait
    if compute <= 0:
        return None
    load = wait if have == 0 else have * (compute + wait)
    # 1e-9: a load of exactly k computes needs k workers, not k + 1 from float rounding
    needed = max(1, math.ceil(load / compute - 1e-9))
    return LoadArithmetic(load, compute, total / steps, needed, ctx.setup.grad_accum)


def _usable_cores(ctx: Context) -> int | None:
    """Cores a loader may use: all but one, which the training process needs. None: unknown."""
    cores = ctx.device.cpu_count
    return None if cores <= 0 else max(1, cores - 1)


class LoadEvidence(TypedDict, total=False):
    """The load arithmetic a finding quotes (empty when the profile has none)."""

    load_seconds_per_batch: float | None
    batches_per_step: int | None
    load_seconds_per_step: float
    compute_seconds_per_step: float
    workers_needed: int


def _load_evidence(a: LoadArithmetic | None) -> LoadEvidence:
    if a is None:
        return LoadEvidence()
    lb = a.load_s_per_batch
    return LoadEvidence(
        load_seconds_per_batch=None if lb is None else round(lb, 4),
        batches_per_step=a.batches_per_step,
        load_seconds_per_step=round(a.load_s_per_step, 4),
        compute_seconds_per_step=round(a.compute_s_per_step, 4),
        workers_needed=a.workers_needed,
    )


def _effect(share: float, a: LoadArithmetic, k: int) -> str:
    """What k workers and pre-processing each make of the step, by the same arithmetic."""
    now = a.step_s
    with_k = max(a.compute_s_per_step, a.load_s_per_step / k)
    return (
        f"up to {pct(share)} shorter steps: the step ({now:.3g} s) would take "
        f"max(compute, load / workers) = {with_k:.3g} s with {k} worker{'s' if k > 1 else ''} "
        f"({now / with_k:.2f}x), and its {a.compute_s_per_step:.3g} s of compute once "
        f"batches cost nothing to load ({now / a.compute_s_per_step:.2f}x)"
    )


@rule("input-bound")
def input_bound(ctx: Context) -> Finding | None:
    v = ctx.verdict
    share = ctx.shares.get("data_wait", 0.0)
    if v is None or share < INPUT_MODERATE:
        return None
    workers = workers_in_use(ctx)
    a = load_arithmetic(ctx)
    usable = _usable_cores(ctx)
    s = ctx.setup
    effect = f"up to {pct(share)} shorter steps if loading overlaps compute completely"
    if a is not None:
        need = a.workers_needed
        effect = _effect(
            share, a, need if usable is None or need <= usable else max(usable, workers or 0)
        )
        why = (
            f"loading takes {a.load_s_per_step:.3g} s per step against {a.compute_s_per_step:.3g} s "
            f"of compute, so {need} loader worker{'s' if need > 1 else ''} would hide it"
        )
        if usable is not None and need > usable:
            # More workers than cores cannot hide the load: only cheaper batches can.
            k = max(usable, workers or 0)  # never fewer workers than the run has
            keep = "keep " if k == workers else ""
            why += f"; this machine has {ctx.device.cpu_count} cores (one for training)"
            fix = s.fix(
                f"{PITSTOP_TOKENIZE} ({why}); meanwhile {keep}--loader-workers {k}",
                f"{HF_TOKENIZE} ({why}); meanwhile {keep}dataloader_num_workers={k}, "
                "dataloader_pin_memory=True, dataloader_persistent_workers=True",
                f"{LOOP_TOKENIZE} ({why}); meanwhile {keep}{LOOP_WORKERS.format(k=k)}",
            )
        else:
            fix = s.fix(
                f"--loader-workers {need} ({why}); keep the data as a prepared token store on local disk",
                f"dataloader_num_workers={need}, dataloader_pin_memory=True, "
                f"dataloader_persistent_workers=True ({why}); cheaper batches still: {HF_TOKENIZE}",
                f"{LOOP_WORKERS.format(k=need)} ({why}); cheaper batches still: {LOOP_TOKENIZE}",
            )
    else:
        k = _input_bound_workers(ctx)
        # None: the loader already has every core it can use; the per-batch work is the cost
        if k is None:
            fix = s.fix(
                f"keep --loader-workers {workers} (no core is left for more); {PITSTOP_TOKENIZE}",
                f"keep dataloader_num_workers={workers} (no core is left for more); {HF_TOKENIZE}; "
                "dataloader_pin_memory=True, dataloader_persistent_workers=True",
                f"keep num_workers={workers} (no core is left for more); {LOOP_TOKENIZE}",
            )
        else:
            fix = s.fix(
                f"--loader-workers {k} (loading in worker processes overlaps the step); "
                "keep the data as a prepared token store on local disk",
                f"dataloader_num_workers={k}, dataloader_pin_memory=True, "
                f"dataloader_persistent_workers=True; {HF_TOKENIZE}",
                f"{LOOP_WORKERS.format(k=k)}; {LOOP_TOKENIZE}",
            )
    return Finding(
        id="input-bound",
        severity="high" if share >= INPUT_SEVERE else "medium",
        title=f"steps wait for data {pct(share)} of the time ({'severe' if share >= INPUT_SEVERE else 'moderate'} input-bound)",
        evidence={
            "data_wait_share": round(share, 4),
            "loader_workers": workers,
            "cpu_cores": ctx.device.cpu_count or None,
            **_load_evidence(a),
            "thresholds": {"moderate": INPUT_MODERATE, "severe": INPUT_SEVERE},
        },
        effect=effect,
        basis="measured in this profile",
        fix=fix,
        gain=share,
        gain_measured=True,
    )


@rule("loader-main-process")
def loader_main_process(ctx: Context) -> Finding | None:
    """pitstop's default (loader_workers unset) picks workers from the CPU count: quiet."""
    if ctx.setup.loader_workers != 0:
        return None
    if ctx.shares.get("data_wait", 0.0) >= INPUT_MODERATE:
        return None  # input-bound reports it, with the measured share and the same fix
    share = ctx.shares.get("data_wait")
    measured = share is not None
    a = load_arithmetic(ctx)
    usable = _usable_cores(ctx)
    # Measured: the workers that hide the measured load (within the cores); else the default.
    k = _suggest_workers(ctx) if a is None else min(a.workers_needed, usable or a.workers_needed)
    # Unmeasured on a GPU: the device waits for every batch, which matters more than on a CPU.
    if (share or 0) >= INPUT_SEVERE:
        severity = "high"
    elif (measured and share >= INPUT_MODERATE) or (not measured and ctx.cuda):
        severity = "medium"
    else:
        severity = "low"
    return Finding(
        id="loader-main-process",
        severity=severity,
        title="batches are loaded on the training process (0 loader workers)",
        evidence={
            "loader_workers": 0,
            "cpu_cores": ctx.device.cpu_count or None,
            "data_wait_share": None if share is None else round(share, 4),
            **_load_evidence(a),
        },
        effect=(
            f"the {pct(share)} of step time spent loading would overlap compute"
            if measured
            else "every batch is read and collated between steps while the device waits; "
            "with workers it overlaps the previous step"
        ),
        basis="measured in this profile" if measured else "documented",
        reference=None if measured else LOADING_DOCS,
        fix=ctx.setup.fix(
            f"--loader-workers {k}", f"dataloader_num_workers={k}", LOOP_WORKERS.format(k=k)
        ),
        gain=share or 0.0,
        gain_measured=measured,
    )


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
        fix=ctx.setup.fix(
            f"--loader-workers {k}",
            f"dataloader_num_workers={k}",
            f"DataLoader(..., num_workers={k})",
        ),
    )
