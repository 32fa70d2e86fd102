"""`pitstop tune -- CMD`: what each of the doctor's fixes is worth, measured on the user's script.

The flow (docs/tune.md, "Tuning any script"):

1. the command runs unchanged as the baseline, under the step timer, for warm-up + K optimizer
   steps (a clean stop from the optimizer hook; `max_steps` for a Trainer script), and the
   doctor reads it;
2. `make_plan` (script_plan.py) turns the doctor's findings and the observed settings into
   candidates, each a setting pitstop applies from outside (`script_settings`), labelled by
   what it does to the training math; fixes that cannot be applied from outside are listed
   with the reason;
3. each candidate and the baseline alternate (baseline, candidate, baseline, candidate, ...)
   until `judge` separates them from the noise or the budget ends;
4. the winners are combined and the combination measured the same way;
5. one table, the winning settings as code to paste, and tuned_settings.json.

This module runs no process itself: the caller passes a `Runner` (the command layer passes
`pitstop.anyloop.launch.run_command` with the settings in the environment), which keeps
`tune` below `anyloop` in the layer order and lets tests pass a fake runner.

The ratio of a candidate to the baseline is the ratio of their steady throughputs
(`report/steady.py`: trained tokens over seconds of the steps after warm-up, else steps per
second), and its band the block-rate band `compare` uses. Rounds are pooled in log space;
a verdict is "faster" or "slower" only when the pooled band excludes 1 and no round points
the other way, so a round slowed by a busy machine can blur a verdict, never flip it.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from pitstop.advise.finding import Finding
from pitstop.core.atomic import write_json_atomic
from pitstop.core.errors import DataError
from pitstop.core.process_group import TimeLimitReached
from pitstop.core.run_record import FINDINGS, HF_PROFILE, SUMMARY, no_step_seen
from pitstop.probe import DeviceInfo
from pitstop.tune.script_plan import (
    BATCH,
    PRECISION,
    SAME,
    Candidate,
    NotTried,
    Plan,
    make_plan,
)
from pitstop.tune.script_settings import APPLIED, Applied, TrialSettings, Value

DEFAULT_BUDGET_SECONDS = 600.0  # the whole search; enough for a script whose step is <= 1 s
DEFAULT_STEPS = 12  # measured optimizer steps per trial (after warm-up)
DEFAULT_WARMUP = 2  # steps left out of each trial (worker start-up, allocator, first kernels)
MAX_ROUNDS = 3  # baseline/candidate pairs per candidate at most
# A verdict needs two pairs at least: one pair's runs can both fall in a burst of another
# process's load (a 3x slower candidate was seen that way on a shared 2-core machine).
MIN_ROUNDS = 2
TUNED = "tuned_settings.json"

FASTER, SLOWER, SAME_SPEED = "faster", "slower", "no measurable difference"
FAILED, NOT_MEASURED = "failed", "not measured (budget)"

# Runner(command, run_dir, settings, warmup_steps, seconds) -> exit status; writes a run to
# run_dir. Past `seconds` it ends the trial with every process it started and raises
# TimeLimitReached: a script stuck before its first step would otherwise hold tune forever.
Runner = Callable[[list[str], Path, TrialSettings, int, float], int]


class BudgetSpent(Exception):
    """A trial was still running when the budget was spent; the runner stopped it."""

    def __init__(self, trial: str, run_dir: Path, stop: TimeLimitReached, first_step: bool) -> None:
        super().__init__(f"{trial}: {stop}")
        self.trial, self.run_dir, self.stop, self.first_step = trial, run_dir, stop, first_step

    def describe(self) -> str:
        """What the trial had done and how it was stopped, e.g. "the baseline ran 20 s
        without an optimizer step (the budget); stopped it (SIGTERM to its process group)"."""
        seconds = f"{self.stop.seconds:.0f} s"
        if self.first_step:
            did = f"was still running after {seconds} (the budget), past its first optimizer step"
        else:
            did = f"ran {seconds} without an optimizer step (the budget)"
        return f"the {self.trial} {did}; {self.stop.how}"


@dataclass
class Round:
    """One baseline/candidate pair: throughputs (tokens/s, else steps/s) and the half-width
    of the pair's band in log space (wider when either run was flagged noisy)."""

    base_rate: float
    cand_rate: float
    half: float  # log of the pair's band upper bound (report/steady.band)

    @property
    def log_ratio(self) -> float:
        return math.log(self.cand_rate / self.base_rate)


@dataclass
class Judgement:
    ratio: float
    low: float
    high: float
    verdict: str


@dataclass
class Result:
    """A candidate (or the combination) as measured."""

    candidate: Candidate
    runs: list[str] = field(default_factory=list)  # its run directories, in order
    rounds: list[Round] = field(default_factory=list)
    judgement: Judgement | None = None
    error: str | None = None  # why the trial failed
    applied: dict[str, Value] = field(default_factory=dict)  # what the trial set, as applied
    refused: dict[str, str] = field(default_factory=dict)

    @property
    def verdict(self) -> str:
        if self.error:
            return FAILED
        return self.judgement.verdict if self.judgement else NOT_MEASURED


@dataclass
class ScriptTuneReport:
    command: list[str]
    output: Path
    baseline: str
    plan: Plan
    results: list[Result]
    combined: Result | None
    winners: list[Result]
    held_back: list[Result]  # faster, but change the batch (without --allow-batch-changes)
    seconds: float

    def recommended(self) -> dict[str, Value]:
        """The winning settings, as the user writes them (loader or TrainingArguments)."""
        out: dict[str, Value] = {}
        for r in self.winners:
            out.update(r.applied or {**r.candidate.loader, **r.candidate.training_args})
        return out


# --- judging ------------------------------------------------------------------------------


def judge(rounds: list[Round], floor: float, min_rounds: int = MIN_ROUNDS) -> Judgement:
    """Pool the rounds (log space): ratio, band and verdict.

    The band's half-width is the largest of: the pairs' own bands pooled (each pair's band
    already holds its block spread and the noise floor), the spread between rounds (with two
    or more: Student's t times its standard error), and `floor`. "faster" / "slower" need the band to exclude 1 and every round to
    point the same way, over `min_rounds` pairs at least: one round slowed by a busy machine
    makes the verdict "no measurable difference", never the opposite one.
    """
    logs = [r.log_ratio for r in rounds]
    n = len(logs)
    mean = statistics.fmean(logs)
    half = math.sqrt(sum(r.half**2 for r in rounds)) / n
    if n >= 2:
        half = max(half, _t95(n - 1) * statistics.stdev(logs) / math.sqrt(n))
    half = max(half, math.log1p(floor))
    verdict = SAME_SPEED
    if n < min_rounds:
        pass
    elif mean - half > 0 and all(x > 0 for x in logs):
        verdict = FASTER
    elif mean + half < 0 and all(x < 0 for x in logs):
        verdict = SLOWER
    return Judgement(math.exp(mean), math.exp(mean - half), math.exp(mean + half), verdict)


# Student's t, 97.5% quantile, by degrees of freedom: the spread of two or three pairs is a
# poor estimate of the noise, and a normal quantile (2) read it as far too certain (two
# pairs both caught in bursts of another process's load gave a false "slower" at 0.51x).
_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57}


def _t95(dof: int) -> float:
    return _T95.get(dof, 2.0 if dof > 30 else 2.45)


def pair(base_dir: Path, cand_dir: Path) -> Round:
    """The round of two run directories (steady throughput and `compare`'s band)."""
    from pitstop.report.runs import load_run
    from pitstop.report.steady import band, steady

    a, b = steady(load_run(base_dir)), steady(load_run(cand_dir))
    if a is None or b is None:
        raise DataError("fewer than 3 steady steps: give more --steps")

    def rate(s: Any) -> float:
        tokens = a.tokens_per_second is not None and b.tokens_per_second is not None
        return s.tokens_per_second if tokens else 1.0 / s.step_seconds

    lo_hi = band(a, b)
    assert lo_hi is not None  # both steady: band is defined
    return Round(rate(a), rate(b), math.log(lo_hi[1]))


# --- the search ---------------------------------------------------------------------------


class _Search:
    def __init__(
        self,
        command: list[str],
        output: Path,
        runner: Runner,
        *,
        steps: int,
        warmup: int,
        budget_seconds: float,
        bf16_native: bool,
        log: Callable[[str], None],
        max_pairs: int = MAX_ROUNDS,
    ) -> None:
        self.command, self.output, self.runner = command, output, runner
        self.steps, self.warmup = steps, warmup
        self.deadline = time.monotonic() + budget_seconds
        self.bf16_native = bf16_native
        self.log = log
        self.max_pairs = max_pairs
        self.n = 0
        self.trial_seconds: list[float] = []

    def run(self, name: str, cand: Candidate | None) -> tuple[Path, int, Applied]:
        """One trial: its run directory, exit status and applied.json. BudgetSpent when the
        budget ran out while it ran (the runner stopped it)."""
        self.n += 1
        slug = re.sub(r"[^A-Za-z0-9_.=-]+", "_", name)[:60]
        run_dir = self.output / f"{self.n:02d}-{slug}"
        settings = TrialSettings(
            trial_dir=str(run_dir.resolve()),
            stop_after_steps=self.steps + self.warmup,
            loader=dict(cand.loader) if cand else {},
            training_args=dict(cand.training_args) if cand else {},
            bf16_native=self.bf16_native,
            autocast=cand.autocast if cand else None,
        )
        self.log(f"trial {self.n}: {name} -> {run_dir}")
        t = time.monotonic()
        try:
            rc = self.runner(self.command, run_dir, settings, self.warmup, self.deadline - t)
        except TimeLimitReached as e:
            what = "baseline" if cand is None else f"trial {name}"
            raise BudgetSpent(what, run_dir, e, _applied(run_dir).first_step) from None
        self.trial_seconds.append(time.monotonic() - t)
        return run_dir, rc, _applied(run_dir)

    def fits(self, trials: int) -> bool:
        per = max(self.trial_seconds) if self.trial_seconds else 0.0
        return time.monotonic() + trials * per <= self.deadline

    def measure(self, cand: Candidate, base_dir: Path | None, floor: float) -> Result:
        """Alternate baseline and candidate until judged apart, MAX_ROUNDS, or the budget."""
        res = Result(cand)
        try:
            self._pairs(res, base_dir, floor)
        except BudgetSpent as e:  # what was measured before stands, as at a budget's end
            self.log(f"{e.describe()}; the budget is spent")
        return res

    def _pairs(self, res: Result, base_dir: Path | None, floor: float) -> None:
        cand = res.candidate
        while len(res.rounds) < self.max_pairs:
            if base_dir is None:
                if not self.fits(2):
                    break
                base_dir, rc, _ = self.run("baseline", None)
                if rc != 0 or not (base_dir / SUMMARY).is_file():
                    res.error = _failed("the baseline rerun", rc, base_dir)
                    return
            elif not self.fits(1):
                break
            cand_dir, rc, applied = self.run(cand.name, cand)
            res.runs += [str(base_dir), str(cand_dir)]
            res.refused = dict(applied.refused)
            res.applied = _user_fields(applied, cand)
            if rc != 0 or not (cand_dir / SUMMARY).is_file():
                res.error = _failed("the trial", rc, cand_dir)
                return
            if res.refused and not res.applied:
                res.error = "not applied: " + "; ".join(f"{k}: {v}" for k, v in res.refused.items())
                return
            try:
                res.rounds.append(pair(base_dir, cand_dir))
            except Exception as e:  # a run too short or damaged: reported, the search goes on
                res.error = str(e)
                return
            base_dir = None
            res.judgement = judge(res.rounds, floor)
            if res.judgement.verdict != SAME_SPEED:
                break


def _applied(run_dir: Path) -> Applied:
    """The trial's applied.json (empty when the trial wrote none)."""
    if not (run_dir / APPLIED).is_file():
        return Applied()
    return Applied(**json.loads((run_dir / APPLIED).read_text(encoding="utf-8")))


def _failed(what: str, rc: int, run_dir: Path) -> str:
    """Why a trial left no run: its exit status, or, when it exited 0, that it took no
    optimizer step pitstop could see (it did not fail: it trained nothing timed)."""
    if rc == 0:
        return no_step_seen(what, run_dir)
    return f"{what} exited with status {rc} (see {run_dir})"


def _finding(d: dict[str, object]) -> Finding:
    """A finding as findings.json keeps it (Finding.to_dict), back as a Finding."""
    names = {f.name for f in fields(Finding)}
    return Finding(**{k: v for k, v in d.items() if k in names})  # type: ignore[arg-type]


def _user_fields(applied: Applied, cand: Candidate) -> dict[str, Value]:
    """What the trial set that the user would write (the safety fields left out)."""
    if cand.autocast:
        return {"autocast": applied.autocast} if applied.autocast else {}
    if cand.loader:
        return {k: v for k, v in cand.loader.items()}
    args = applied.training_args
    keys = set(cand.training_args)
    if "per_device_train_batch_size" in keys:
        keys.add("gradient_accumulation_steps")
    if "bf16" in keys:
        keys |= {"fp16", "use_cpu"}
    if "padding_free" in keys:
        keys.add("max_length")  # set to None with it where the script had one
    return {k: args[k] for k in sorted(keys) if k in args}


def tune_script(
    command: list[str],
    output: str | Path,
    runner: Runner,
    *,
    budget_seconds: float = DEFAULT_BUDGET_SECONDS,
    steps: int = DEFAULT_STEPS,
    warmup: int = DEFAULT_WARMUP,
    allow_batch_changes: bool = False,
    device: DeviceInfo | None = None,
    max_pairs: int = MAX_ROUNDS,
    log: Callable[[str], None] = lambda _: None,
) -> ScriptTuneReport:
    """Baseline, plan, candidates measured against the baseline, winners combined."""
    from pitstop.advise.doctor import device_from_dict
    from pitstop.report.steady import NOISE_FLOOR

    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    search = _Search(
        command,
        out,
        runner,
        steps=steps,
        warmup=warmup,
        budget_seconds=budget_seconds,
        bf16_native=False,
        log=log,
        max_pairs=max_pairs,
    )
    base_dir, applied = _baseline(search, steps + warmup)
    profile = json.loads((base_dir / HF_PROFILE).read_text(encoding="utf-8"))
    findings_path = base_dir / FINDINGS
    report = (
        json.loads(findings_path.read_text(encoding="utf-8")) if findings_path.is_file() else {}
    )
    dev = device or device_from_dict(profile.get("device")) or DeviceInfo(type="cpu", name="cpu")
    search.bf16_native = bool(dev.bf16)
    plan = make_plan(
        [_finding(f) for f in report.get("findings") or []],
        dict(profile.get("config") or {}),
        applied.script_args if applied.trainer else None,
        dev,
        allow_batch_changes=allow_batch_changes,
    )
    results: list[Result] = []
    first: Path | None = base_dir  # the first candidate's first round reuses the baseline
    for cand in plan.candidates:
        results.append(search.measure(cand, first, NOISE_FLOOR))
        first = None
        log(f"{cand.name}: {_measured(results[-1])} -> {results[-1].verdict}")
    winners, held = _winners(results, allow_batch_changes)
    combined = None
    if len(winners) > 1:
        combined = search.measure(_combination(winners), None, NOISE_FLOOR)
    elif winners:
        combined = winners[0]  # the combination of one fix is that fix, measured above
    rep = ScriptTuneReport(
        command, out, str(base_dir), plan, results, combined, winners, held, time.monotonic() - t0
    )
    write_json_atomic(out / TUNED, report_json(rep))
    return rep


def _baseline(search: _Search, steps: int) -> tuple[Path, Applied]:
    """The baseline trial's run directory and applied.json; DataError when it left no run
    (stopped at the budget's end, exited 0 without a step, or failed)."""
    try:
        base_dir, rc, applied = search.run("baseline", None)
    except BudgetSpent as e:
        raise DataError(
            f"{e.describe()}; nothing to compare against (nothing written but {e.run_dir}). "
            + _why_stopped(e.first_step, steps)
        ) from None
    if (base_dir / SUMMARY).is_file() and rc == 0:
        return base_dir, applied
    if rc == 0:
        raise DataError(
            f"{no_step_seen('the baseline (exit status 0)', base_dir)}; nothing to compare against"
        )
    raise DataError(
        f"the baseline run failed (exit status {rc}); nothing to compare against: run "
        f"`pitstop profile -- {' '.join(search.command)}` to see why"
    )


def _why_stopped(first_step: bool, steps: int) -> str:
    """What to do about a baseline the budget stopped."""
    if first_step:
        return f"Its {steps} steps take longer than the budget: give more --budget-seconds"
    return (
        "A script stuck before its first step waits on something (data loading, a lock, the "
        "network); run the command alone to see where, or give more --budget-seconds if its "
        "start-up is that slow"
    )


def _winners(results: list[Result], allow_batch_changes: bool) -> tuple[list[Result], list[Result]]:
    """(the fastest faster candidate of each group, the faster ones held back because they
    change the batch and --allow-batch-changes was not given)."""
    best: dict[str, Result] = {}
    held: list[Result] = []
    for r in results:
        if r.verdict != FASTER:
            continue
        if r.candidate.math == BATCH and not allow_batch_changes:
            held.append(r)
            continue
        g = r.candidate.group
        if g not in best or r.judgement.ratio > best[g].judgement.ratio:  # type: ignore[union-attr]
            best[g] = r
    return list(best.values()), held


def _combination(winners: list[Result]) -> Candidate:
    """Every winner's setting at once; its math the most changing of theirs."""
    return Candidate(
        " + ".join(w.candidate.name for w in winners),
        "combined",
        max((w.candidate.math for w in winners), key=[SAME, PRECISION, BATCH].index),
        loader={k: v for w in winners for k, v in w.candidate.loader.items()},
        training_args={k: v for w in winners for k, v in w.candidate.training_args.items()},
        autocast=next((w.candidate.autocast for w in winners if w.candidate.autocast), None),
    )


# --- output -------------------------------------------------------------------------------


def _measured(r: Result) -> str:
    j = r.judgement
    if r.error or j is None:
        return "-"
    return f"{j.ratio:.2f}x [{j.low:.2f}-{j.high:.2f}]"


def settings_code(rep: ScriptTuneReport) -> str:
    """The winning settings as code to paste: DataLoader or TrainingArguments arguments."""
    rec = dict(rep.recommended())
    autocast = rec.pop("autocast", None)
    parts = []
    if rec:
        args = ", ".join(f"{k}={v!r}" for k, v in rec.items())
        what = "DataLoader" if rep.plan.kind == "loop" else "TrainingArguments"
        parts.append(f"{what}(..., {args})")
    if autocast:
        parts.append(
            "with torch.autocast(device_type, dtype=torch.bfloat16): around the model's "
            "forward and the loss"
        )
    return "; ".join(parts)


@dataclass
class ResultRecord:
    """One candidate's line in tuned_settings.json."""

    fix: str
    math: str
    finding: str | None
    predicted: str
    verdict: str
    judgement: Judgement | None
    rounds: int
    runs: list[str]
    error: str | None
    refused: dict[str, str]

    @classmethod
    def of(cls, r: Result) -> ResultRecord:
        c = r.candidate
        return cls(
            c.name,
            c.math,
            c.finding,
            c.predicted,
            r.verdict,
            r.judgement,
            len(r.rounds),
            r.runs,
            r.error,
            r.refused,
        )


@dataclass
class TunedSettings:
    """tuned_settings.json: the recommendation (as DataLoader or TrainingArguments arguments,
    and as code) and every result."""

    command: list[str]
    kind: str
    baseline: str
    dataloader_kwargs: dict[str, Value]  # a plain loop's recommendation (else empty)
    training_args: dict[str, Value]  # a Trainer script's recommendation (else empty)
    code: str
    results: list[ResultRecord]
    autocast: str | None  # a plain loop's winning autocast dtype ("bf16"), else None
    combined: ResultRecord | None
    held_back: list[str]
    not_tried: list[NotTried]
    seconds: float
    schema: str = "pitstop.tune-script/1"


def report_json(rep: ScriptTuneReport) -> dict[str, object]:
    """tuned_settings.json's content (TunedSettings as JSON)."""
    rec = dict(rep.recommended())
    autocast = rec.pop("autocast", None)
    loop = rep.plan.kind == "loop"
    return asdict(
        TunedSettings(
            command=rep.command,
            kind=rep.plan.kind,
            baseline=rep.baseline,
            dataloader_kwargs=rec if loop else {},
            training_args={} if loop else rec,
            code=settings_code(rep),
            results=[ResultRecord.of(r) for r in rep.results],
            autocast=str(autocast) if autocast else None,
            combined=ResultRecord.of(rep.combined) if rep.combined else None,
            held_back=[r.candidate.name for r in rep.held_back],
            not_tried=rep.plan.not_tried,
            seconds=round(rep.seconds, 1),
        )
    )


def format_script_report(rep: ScriptTuneReport) -> str:
    """The table, the fixes not tried, and the winning settings as code."""
    head = ["fix", "predicted", "measured (band)", "pairs", "verdict", "math"]
    rows = [
        [
            r.candidate.name,
            r.candidate.predicted,
            _measured(r),
            str(len(r.rounds)),
            r.verdict + (f": {r.error}" if r.error else ""),
            r.candidate.math,
        ]
        for r in rep.results
    ]
    if rep.combined is not None and rep.combined.candidate.group == "combined":
        c = rep.combined
        rows.append(
            [c.candidate.name, "-", _measured(c), str(len(c.rounds)), c.verdict, c.candidate.math]
        )
    widths = [
        max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(head)
    ]
    lines = [f"pitstop tune: {' '.join(rep.command)}", f"baseline: {rep.baseline}", ""]
    if rows:
        lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)))
        lines.append("  ".join("-" * w for w in widths))
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
        lines.append(
            "(measured: steady throughput of the trial / the baseline's, band as compare's)"
        )
    for n in rep.plan.not_tried:
        if n.fix != "anything":  # said in the last line
            lines.append(f"not tried: {n.fix}: {n.reason}")
    for r in rep.held_back:
        lines.append(
            f"held back: {r.candidate.name} is faster but {r.candidate.math} "
            "(add --allow-batch-changes to include it)"
        )
    lines.append("")
    code = settings_code(rep)
    if not rep.results:
        lines.append(f"nothing was tried: {_why_nothing(rep)}; keep the script's settings")
    elif not code:
        lines.append("no change beats the noise: keep the script's settings")
    else:
        if rep.combined is not None:
            lines.append(f"combined: {_measured(rep.combined)} ({rep.combined.verdict})")
        lines.append("winning settings (paste into the script):")
        lines.append(f"  {code}")
    lines.append(
        f"\nevery trial is a run directory under {rep.output} (pitstop compare / "
        f"report); settings as JSON: {rep.output / TUNED}"
    )
    return "\n".join(lines)


def _why_nothing(rep: ScriptTuneReport) -> str:
    """Why the plan holds no candidate: the doctor found nothing, or nothing it found can
    be changed from outside the script."""
    if any(n.fix == "anything" for n in rep.plan.not_tried):
        return "the doctor found nothing to change in the baseline run"
    return (
        "no fix the doctor proposed can be applied from outside the script (its findings: "
        f"{Path(rep.baseline) / FINDINGS})"
    )


def format_dry_run(
    command: list[str], output: Path, *, steps: int, warmup: int, budget_seconds: float
) -> str:
    """What `pitstop tune -- CMD` would do, without running anything."""
    return "\n".join(
        [
            f"pitstop tune (dry run): {' '.join(command)}",
            f"1. baseline: the command unchanged, {warmup} warm-up + {steps} measured optimizer "
            f"steps, then a clean stop; run directory {output}/01-baseline",
            "2. the doctor reads it; each fix pitstop can apply from outside becomes a candidate:",
            "   plain loop: DataLoader(num_workers, pin_memory on CUDA, persistent_workers)",
            "   Trainer / TRL: dataloader_* fields, bf16 (native bf16 only), tf32 (CUDA only), "
            "gradient_checkpointing=False, optim='adamw_torch_fused', torch_compile, micro-batch "
            "x accumulation split (same product), group_by_length (--allow-batch-changes)",
            f"3. baseline and candidate alternate (at most {MAX_ROUNDS} pairs) until the noise "
            f"band separates them or {budget_seconds:.0f} s are spent; the winners are combined "
            "and measured",
            "trial safety: each trial writes under its own directory; a Trainer script gets "
            "save_strategy='no', report_to='none', push_to_hub=False, output_dir and logging_dir "
            f"inside the trial, max_steps={steps + warmup}; a plain loop stops after "
            f"{steps + warmup} optimizer steps, but files it writes itself (its own torch.save, "
            "logs, outputs) are written as the script says: guard them",
        ]
    )
