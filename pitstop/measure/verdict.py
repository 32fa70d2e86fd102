"""The bottleneck verdict: which part of the step a profile says to fix first.

Every verdict is read off the measured phase shares of a profile (see
`pitstop.measure.schema`), with the numbers it used as evidence:

- input-bound: the step waits for the data loader. data_wait ≥ 5% of step time is
  moderate, ≥ 20% severe. Time spent waiting is time the device idles, so the
  share is also the most a faster loader can save.
- checkpoint-bound: saving takes ≥ 5% (moderate) / ≥ 20% (severe) of step time.
- eval-bound: evaluation (forward passes without gradients or in eval() mode, with their
  batches) takes ≥ 10% / ≥ 30% of step time: the run trains nothing meanwhile. An
  evaluation is meant to cost something, so its thresholds are higher than a checkpoint's.
- optimizer-bound: the optimizer step takes ≥ 25% / ≥ 40%. The AdamW update is
  memory-bound (it reads and writes ~16 bytes per parameter) while forward+backward
  do 6 FLOPs per parameter per token, so a large optimizer share means few tokens
  per optimizer step or an unfused optimizer.
- sync-bound: host-side time nobody's phase explains ("other") plus logging takes
  ≥ 15% / ≥ 30% of the step (host-device synchronisation on a GPU, Python overhead,
  `.item()` calls, allocator flushes). On a CPU there is no device to synchronise
  with, and the verdict does not name one; logging is named only where it was measured.
- noisy-machine: step times are erratic (coefficient of variation ≥ 0.5 with the
  slowest step ≥ 3x the median, while checkpoint and eval, which legitimately make
  single steps long, take under 1%) and the machine was measured busy: other processes
  used at least a fifth of its cores while the profile ran
  (`pitstop.measure.machine.shared_by_others`), or, where that was not measured, its load
  average reached its core count (the load average also counts the run's own loader
  workers, so the measured CPU time of others decides when there is one). Erratic steps on
  a machine measured quiet are the run's own behaviour (a loader's workers all busy every
  Nth step, a periodic pause), never noisy-machine: input-bound explains them when the run
  waits for data, else sync-bound names them. A profile that recorded no machine load at
  all keeps the older reading (erratic steps that host time does not explain: another
  process, probably) and says the load was not recorded. Steady steps are noisy-machine
  too when others were measured using a fifth of the cores: a steadily shared CPU slows
  every step alike. That one comes last, not first: the shares, slowed alike, still say
  where the step goes. No configuration change follows from a noisy profile, so the erratic
  kind comes first and every other share it lists is suspect.
- compute-bound: none of the above; forward+backward dominate, which is where a
  training step should spend its time. Gains then come from fewer FLOPs (padding,
  recomputation) or faster kernels, and MFU says how much headroom is left.

The thresholds are pitstop's choices, not measurements; they are named constants
here so reports can quote them.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, TypedDict

from pitstop.measure.machine import MachineLoad, loaded_by_average, shared_by_others

INPUT_MODERATE, INPUT_SEVERE = 0.05, 0.20
CHECKPOINT_MODERATE, CHECKPOINT_SEVERE = 0.05, 0.20
EVAL_MODERATE, EVAL_SEVERE = 0.10, 0.30
OPTIMIZER_MODERATE, OPTIMIZER_SEVERE = 0.25, 0.40
SYNC_MODERATE, SYNC_SEVERE = 0.15, 0.30
SPREAD_CV, SPREAD_MAX_OVER_MEDIAN = 0.5, 3.0
# A machine whose 1-minute load average is at least this many times its cores is shared.
BUSY_LOAD_PER_CORE = 1.0

COMPUTE_PHASES = ("host_to_device", "forward", "backward")

# A profile as JSON holds it (pitstop.measure.schema), and a verdict's evidence: the numbers
# a rule read, by name.
Profile = dict[str, Any]
Evidence = dict[str, Any]


class VerdictRecord(TypedDict):
    """A Verdict as JSON holds it (`Verdict.to_dict`; the doctor's report)."""

    kind: str
    severity: str
    share: float
    summary: str
    evidence: Evidence
    also: list[VerdictRecord]


@dataclass
class Verdict:
    """One bottleneck: its kind, how bad, the share of step time it takes, and the evidence."""

    kind: str  # input-bound | checkpoint-bound | eval-bound | optimizer-bound | sync-bound | noisy-machine | compute-bound
    severity: str  # severe | moderate | ok
    share: float  # fraction of step time the bottleneck takes (what fixing it could save at most)
    summary: str
    evidence: Evidence = field(default_factory=dict)
    also: list[Verdict] = field(default_factory=list)  # further bottlenecks, worst first

    def to_dict(self) -> VerdictRecord:
        return VerdictRecord(**asdict(self))


def phase_shares(profile: Profile) -> tuple[dict[str, float], float]:
    """({phase: fraction of step time}, total step seconds) of a profile."""
    phases = {k: float(v) for k, v in (profile.get("phases") or {}).items()}
    total = float(sum(profile.get("step_seconds") or [])) or sum(phases.values())
    if total <= 0:
        return dict.fromkeys(phases, 0.0), 0.0
    return {k: v / total for k, v in phases.items()}, total


def _level(share: float, moderate: float, severe: float) -> str | None:
    if share >= severe:
        return "severe"
    if share >= moderate:
        return "moderate"
    return None


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


@dataclass
class _Read:
    """What every verdict rule reads off one profile, computed once."""

    profile: Profile
    shares: dict[str, float]
    total: float
    steps: int
    step_s: float
    base: dict[str, float]
    spread: dict[str, float] | None
    erratic: bool
    machine: MachineLoad
    shared: str | None  # measured: others' CPU time during the run
    busy: bool  # the load average reached the cores (no measure of the others' time)
    unmeasured: bool  # no word on the machine's load at all
    on_cpu: bool

    def share(self, phase: str) -> float:
        return self.shares.get(phase, 0.0)

    @property
    def host(self) -> float:
        """Host-side time nobody's phase explains, plus logging."""
        return self.share("other") + self.share("logging")

    @property
    def logged(self) -> bool:
        """Logging was measured (a Trainer's on_log, pitstop's log steps)."""
        return self.share("logging") > 0 or bool((self.profile.get("events") or {}).get("logs"))


def _read(profile: Profile) -> _Read:
    shares, total = phase_shares(profile)
    steps = max(1, int(profile.get("steps") or len(profile.get("step_seconds") or []) or 1))
    step_s = total / steps
    spread = _spread(profile.get("step_seconds") or [])
    periodic = shares.get("checkpoint", 0.0) + shares.get("eval", 0.0)
    erratic = (
        spread is not None
        and spread["cv"] >= SPREAD_CV
        and spread["max_over_median"] >= SPREAD_MAX_OVER_MEDIAN
        and periodic < 0.01
    )
    machine: MachineLoad = profile.get("machine") or {}
    dev = profile.get("device")  # an object, or a bare name ("cpu") in hand-written profiles
    return _Read(
        profile=profile,
        shares=shares,
        total=total,
        steps=steps,
        step_s=step_s,
        base={
            "steps": steps,
            "mean_step_seconds": round(step_s, 6),
            "total_seconds": round(total, 6),
        },
        spread=spread,
        erratic=erratic,
        machine=machine,
        shared=shared_by_others(machine),
        # The load average counts the run's own workers too: evidence of another process
        # only without a measure of the others' CPU time.
        busy=loaded_by_average(machine, BUSY_LOAD_PER_CORE) is not None,
        unmeasured=machine.get("other_cores") is None and machine.get("load_average_1m") is None,
        on_cpu=(dev.get("type") if isinstance(dev, dict) else dev) == "cpu",
    )


def _input_bound(r: _Read) -> Verdict | None:
    data = r.share("data_wait")
    lvl = _level(data, INPUT_MODERATE, INPUT_SEVERE)
    if not lvl:
        return None
    return Verdict(
        kind="input-bound",
        severity=lvl,
        share=data,
        summary=f"the step waits for the data loader {_pct(data)} of the time "
        f"({data * r.step_s:.4f} s of a {r.step_s:.4f} s step); the device idles meanwhile",
        evidence={
            **r.base,
            "data_wait_share": round(data, 4),
            "data_wait_seconds": round(data * r.total, 6),
            "thresholds": {"moderate": INPUT_MODERATE, "severe": INPUT_SEVERE},
        },
    )


def _checkpoint_bound(r: _Read) -> Verdict | None:
    ckpt = r.share("checkpoint")
    lvl = _level(ckpt, CHECKPOINT_MODERATE, CHECKPOINT_SEVERE)
    if not lvl:
        return None
    n = (r.profile.get("events") or {}).get("checkpoints")
    return Verdict(
        kind="checkpoint-bound",
        severity=lvl,
        share=ckpt,
        summary=f"saving checkpoints takes {_pct(ckpt)} of step time"
        + (f" ({n} save(s) in {r.steps} steps)" if n else ""),
        evidence={
            **r.base,
            "checkpoint_share": round(ckpt, 4),
            "checkpoint_seconds": round(ckpt * r.total, 6),
            "checkpoints": n,
            "thresholds": {"moderate": CHECKPOINT_MODERATE, "severe": CHECKPOINT_SEVERE},
        },
    )


def _eval_bound(r: _Read) -> Verdict | None:
    share = r.share("eval")
    lvl = _level(share, EVAL_MODERATE, EVAL_SEVERE)
    if not lvl:
        return None
    events = r.profile.get("events") or {}
    n, forwards = events.get("evals"), events.get("eval_forwards")
    what = ""
    if n:
        what = f" ({n} evaluation(s) in {r.steps} steps" + (
            f", {forwards} forward passes)" if forwards else ")"
        )
    return Verdict(
        kind="eval-bound",
        severity=lvl,
        share=share,
        summary=f"evaluation takes {_pct(share)} of step time{what}; no training happens meanwhile",
        evidence={
            **r.base,
            "eval_share": round(share, 4),
            "eval_seconds": round(share * r.total, 6),
            "evals": n,
            "eval_forwards": forwards,
            "thresholds": {"moderate": EVAL_MODERATE, "severe": EVAL_SEVERE},
        },
    )


def _optimizer_bound(r: _Read) -> Verdict | None:
    opt = r.share("optimizer")
    lvl = _level(opt, OPTIMIZER_MODERATE, OPTIMIZER_SEVERE)
    if not lvl:
        return None
    return Verdict(
        kind="optimizer-bound",
        severity=lvl,
        share=opt,
        summary=f"the optimizer step takes {_pct(opt)} of step time: few tokens per optimizer step "
        "for the parameter count, or an unfused optimizer",
        evidence={
            **r.base,
            "optimizer_share": round(opt, 4),
            "tokens_per_step": r.profile.get("tokens_per_step"),
            "thresholds": {"moderate": OPTIMIZER_MODERATE, "severe": OPTIMIZER_SEVERE},
        },
    )


def _machine_evidence(r: _Read, erratic: bool) -> Evidence:
    return {
        **r.base,
        "step_spread": r.spread,
        "host_share": round(r.host, 4),
        "load_average_1m": r.machine.get("load_average_1m"),
        "cpu_cores": r.machine.get("cpu_cores"),
        "busy": True if not erratic else r.busy or r.shared is not None,
        "shared": r.shared,
        "erratic": erratic,
    }


def _noisy(r: _Read) -> bool:
    """Erratic steps on a machine measured (or, unmeasured, inferred) busy."""
    host_lvl = _level(r.host, SYNC_MODERATE, SYNC_SEVERE)
    return r.erratic and (r.busy or r.shared is not None or (r.unmeasured and not host_lvl))


def _noisy_machine(r: _Read) -> Verdict | None:
    if not _noisy(r) or r.spread is None:
        return None
    load, cores = r.machine.get("load_average_1m"), r.machine.get("cpu_cores")
    why = r.shared or (
        f"load average {load:.1f} on {cores} cores"
        if r.busy
        else f"host-side time (other + logging) is only {_pct(r.host)} of the step (this "
        "profile recorded no machine load, so that other process is inferred)"
    )
    sp = r.spread
    return Verdict(
        kind="noisy-machine",
        severity="moderate",
        share=sp["excess_share"],
        summary=f"step times are erratic (coefficient of variation {sp['cv']:.2f}, slowest step "
        f"{sp['max_over_median']:.1f}x the median) while {why}: another process competes "
        "for the machine; the steady (median) step is the better figure and no configuration "
        "change follows from this profile",
        evidence=_machine_evidence(r, erratic=True),
    )


def _shared_machine(r: _Read) -> Verdict | None:
    """Steady steps, but each one shared the machine: listed last, never the verdict's head."""
    if r.shared is None or _noisy(r):
        return None
    return Verdict(
        kind="noisy-machine",
        severity="moderate",
        share=0.0,
        summary=f"{r.shared} while this profile was measured (their CPU time, not a guess from the "
        "step times, which stayed steady): every figure here is slower than this machine "
        "gives a run alone, and no configuration change follows from it",
        evidence=_machine_evidence(r, erratic=False),
    )


def _sync_bound(r: _Read) -> Verdict | None:
    if _noisy(r):
        return None
    lvl = _level(r.host, SYNC_MODERATE, SYNC_SEVERE)
    # Erratic steps of a run that waits for data are its loader's bursts: input-bound says so.
    bursts = r.erratic and r.spread is not None and r.share("data_wait") < INPUT_MODERATE
    if not (lvl or bursts):
        return None
    why = []
    if lvl:
        what = "plus logging " if r.logged else ""
        why.append(f"unattributed host time ('other') {what}take {_pct(r.host)} of step time")
    if bursts and r.spread is not None:
        why.append(
            f"step times are erratic (coefficient of variation {r.spread['cv']:.2f}, "
            f"slowest step {r.spread['max_over_median']:.1f}x the median)"
            + (
                ""
                if r.unmeasured
                else " on a machine no other process loaded: the run's own pauses"
            )
        )
    logging = "logging, " if r.logged else ""
    causes = (
        f"Python overhead, {logging}or allocator stalls (a CPU run: no device to wait on)"
        if r.on_cpu
        else f"host-device syncs, Python overhead, {logging}or allocator stalls"
    )
    excess = r.spread["excess_share"] if bursts and r.spread else 0.0
    return Verdict(
        kind="sync-bound",
        severity=lvl or "moderate",
        share=max(r.host, excess),
        summary="; ".join(why) + ": " + causes,
        evidence={
            **r.base,
            "other_share": round(r.share("other"), 4),
            "logging_share": round(r.share("logging"), 4),
            "step_spread": r.spread,
            "thresholds": {
                "moderate": SYNC_MODERATE,
                "severe": SYNC_SEVERE,
                "spread_cv": SPREAD_CV,
                "spread_max_over_median": SPREAD_MAX_OVER_MEDIAN,
            },
        },
    )


# The verdict rules, each reading one share (or the step spread) with its evidence.
RULES = (
    _input_bound,
    _checkpoint_bound,
    _eval_bound,
    _optimizer_bound,
    _noisy_machine,
    _sync_bound,
)


def _compute_bound(r: _Read, also: list[Verdict]) -> Verdict:
    compute = sum(r.share(p) for p in COMPUTE_PHASES)
    mfu = r.profile.get("mfu")
    mfu_txt = f" at {_pct(mfu)} MFU" if isinstance(mfu, (int, float)) else ""
    seen, padded = r.profile.get("seen_tokens"), r.profile.get("padded_tokens")
    fewer = "less padding, no recomputation"
    if isinstance(seen, (int, float)) and isinstance(padded, (int, float)) and padded > 0:
        fewer = f"{_pct(max(0.0, 1 - seen / padded))} of the positions computed were padding"
    return Verdict(
        kind="compute-bound",
        severity="ok",
        share=compute,
        summary=f"forward+backward take {_pct(compute)} of step time{mfu_txt}: gains now come from "
        f"fewer FLOPs ({fewer}) or faster kernels",
        evidence={
            **r.base,
            "compute_share": round(compute, 4),
            "mfu": mfu,
            "shares": {k: round(v, 4) for k, v in r.shares.items()},
        },
        also=also,
    )


def verdict(profile: Profile) -> Verdict:
    """The bottleneck verdict of a profile; `also` lists every further bottleneck found."""
    r = _read(profile)
    found = [v for v in (rule(r) for rule in RULES) if v is not None]
    rank = {"severe": 0, "moderate": 1}
    # A noisy machine comes first: every other share was measured through that noise. A
    # steadily shared one comes last: it slowed every phase alike, so the shares still say
    # where the step goes, and it is no bottleneck a setting can fix.
    found.sort(key=lambda v: (v.kind != "noisy-machine", rank[v.severity], -v.share))
    shared = _shared_machine(r)
    last = [shared] if shared is not None else []
    if not found:
        return _compute_bound(r, last)
    first, rest = found[0], found[1:]
    first.evidence["compute_share"] = round(sum(r.share(p) for p in COMPUTE_PHASES), 4)
    first.evidence["shares"] = {k: round(v, 4) for k, v in r.shares.items()}
    first.also = rest + last
    return first


def _spread(step_seconds: list[float]) -> dict[str, float] | None:
    if len(step_seconds) < 8:
        return None  # too few steps to call one slow step a pattern
    med = statistics.median(step_seconds)
    mean = statistics.fmean(step_seconds)
    if med <= 0 or mean <= 0:
        return None
    cv = statistics.pstdev(step_seconds) / mean
    total = sum(step_seconds)
    return {
        # time above the median, i.e. what steady steps would have saved
        "excess_share": round(max(0.0, total - med * len(step_seconds)) / total, 4),
        "cv": round(cv, 3),
        "median_seconds": round(med, 6),
        "max_seconds": round(max(step_seconds), 6),
        "max_over_median": round(max(step_seconds) / med, 2),
    }


def format_verdict(v: Verdict) -> str:
    """One paragraph for a terminal."""
    head = v.kind if v.severity == "ok" else f"{v.kind} ({v.severity})"
    lines = [f"verdict: {head}: {v.summary}"]
    for other in v.also:
        lines.append(f"  also {other.kind} ({other.severity}): {other.summary}")
    return "\n".join(lines)
