"""Rules about feeding the device: input-bound steps, loader workers."""

from __future__ import annotations

from pitstop.advise.finding import Finding
from pitstop.advise.rules.context import Context, pct, rule
from pitstop.measure.verdict import INPUT_MODERATE, INPUT_SEVERE


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
        title=f"steps wait for data {pct(share)} of the time ({'severe' if share >= INPUT_SEVERE else 'moderate'} input-bound)",
        evidence={"data_wait_share": round(share, 4), "loader_workers": workers,
                  "cpu_cores": ctx.device.cpu_count or None,
                  "thresholds": {"moderate": INPUT_MODERATE, "severe": INPUT_SEVERE}},
        effect=f"up to {pct(share)} shorter steps if loading overlaps compute completely",
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
        effect=(f"the {pct(share)} of step time spent loading would overlap compute"
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
