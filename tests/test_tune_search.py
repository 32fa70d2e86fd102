"""The tuner's search against a deterministic cost model: optimum, budget, OOM, training math."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from pitstop.batching.settings import BatchSettings
from pitstop.core.config import build_config, load_yaml
from pitstop.tune.search import (
    OK,
    OOM,
    OVER_MEMORY,
    TrialResult,
    is_oom,
    noise,
    pool,
    search,
    trial_to_trial_noise,
)
from pitstop.tune.space import Settings, Space, apply_settings, resolved_tokens_per_step
from pitstop.tune.trial import TrialCache, median_is_stable
from pitstop.tune.tuner import TuneReport, format_report, write_tuned_config

GiB = 2**30
SPACE = Space(
    max_seq_len=64,
    tokens_per_step=1024,
    max_micro_rows=16,
    batching=("pack", "bucket"),
    loader_workers=(0, 1, 2),
    prefetch_factor=(2, 4),
    compile=(False, True),
    attention=("sdpa", "eager"),
)
START = Settings("pack", 2, 0, 2, False, "eager")
MB_GAIN = {1: 1.0, 2: 1.5, 4: 1.8, 8: 2.0, 16: 2.1}
# The optimum that fits in 6 GiB with 10% headroom (memory 1 + 0.5 x rows GiB: 8 rows = 5 GiB).
OPTIMUM = Settings("bucket", 8, 1, 4, True, "sdpa")


def _cfg(**over):
    values = {
        "model": "m", "data": ["d"], "max_seq_len": 64, "micro_batch_size": 2, "grad_accum": 8,
        "batching": "pack", "compile": "off",
    }  # fmt: skip
    values.update(over)
    return build_config(values, None, command="tune")


@dataclass
class FakeMachine:
    """tokens/s and memory as fixed functions of the settings; each trial costs fake seconds."""

    limit_gib: float = 6.0
    raise_oom: bool = False  # CUDA-style: an over-size trial raises instead of reporting
    oom_message: str | None = None  # raise RuntimeError(message) instead of OutOfMemoryError
    gc_factor: float = 0.4
    base_gib: float = 1.0
    spread: float | None = None  # the p10-p90 spread each trial reports
    slow_from_call: int | None = None  # from this call on, the machine runs 30% slower
    now: float = 0.0
    calls: list[Settings] = field(default_factory=list)
    tokens_per_step_seen: set[int] = field(default_factory=set)

    def clock(self) -> float:
        return self.now

    def memory(self, s: Settings) -> float:
        return (
            self.base_gib + 0.5 * s.micro_rows * (self.gc_factor if s.gradient_checkpointing else 1)
        ) * GiB

    def speed(self, s: Settings) -> float:
        v = 1000.0 * MB_GAIN[s.micro_rows]
        v *= 1.3 if s.batching == "bucket" else 1.0
        v *= 1.2 if s.compile else 1.0
        v *= 1.1 if s.attention == "sdpa" else 1.0
        v *= {0: 1.0, 1: 1.25, 2: 1.15}[s.loader_workers]
        v *= 1.05 if s.loader_workers and s.prefetch_factor == 4 else 1.0
        v *= 0.75 if s.gradient_checkpointing else 1.0
        return v

    def __call__(self, s: Settings) -> TrialResult:
        self.calls.append(s)
        # what the real runner would train with: the tokens per step must never move
        cfg = apply_settings(_cfg(), s, 1024)
        bs = BatchSettings.from_config(cfg, strategy=s.batching)
        self.tokens_per_step_seen.add(bs.tokens_per_step)
        cost = 30.0 if s.compile else 10.0
        self.now += cost
        mem = self.memory(s)
        if self.raise_oom and mem > self.limit_gib * GiB:
            if self.oom_message:
                raise RuntimeError(self.oom_message)
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        slow = (
            0.7 if self.slow_from_call is not None and len(self.calls) > self.slow_from_call else 1
        )
        return TrialResult(
            s, tokens_per_second=slow * self.speed(s), step_seconds=1024 / (slow * self.speed(s)),
            peak_memory_bytes=int(mem), tokens_per_step=bs.tokens_per_step, seconds=cost,
            spread=self.spread, steps=4,
        )  # fmt: skip


def _search(m: FakeMachine, budget: float = 10_000, **kw):
    return search(
        SPACE, m, start=START, budget_seconds=budget, memory_limit_bytes=int(m.limit_gib * GiB),
        clock=m.clock, compile_estimate_seconds=30.0, **kw,
    )  # fmt: skip


def test_finds_the_optimum_without_a_full_grid():
    m = FakeMachine()
    r = _search(m)
    assert r.best.settings == OPTIMUM
    assert r.baseline.settings == START and r.trials[0].role == "start"
    assert r.speedup == pytest.approx(m.speed(OPTIMUM) / m.speed(START))
    grid = 2 * 5 * 3 * 2 * 2 * 2
    assert len(set(m.calls)) < grid / 4  # coordinate descent, not a grid
    searched = [t.settings for t in r.trials if t.role == "search"]
    assert len(set(searched)) == len(searched)  # no setting searched twice
    # every change taken was measured again before it was taken (a recheck)...
    rechecked = {t.settings for t in r.trials if t.role == "recheck"}
    assert OPTIMUM in rechecked
    # ...and the winner and the start were measured side by side at the end
    confirm = [t.settings for t in r.trials if t.role == "confirm"]
    assert confirm == [START, OPTIMUM] and r.confirmed is True
    assert r.best.measurements == 1  # the winner's side-by-side round
    assert r.baseline.measurements == sum(t.settings == START for t in r.trials)  # all of them
    two = _search(FakeMachine(), confirm_rounds=2)  # rounds alternate which goes first
    assert [t.settings for t in two.trials if t.role == "confirm"] == [
        START, OPTIMUM, OPTIMUM, START
    ]  # fmt: skip
    assert two.best.measurements == 2
    assert r.stopped == "converged"
    # 16 rows (9 GiB) is over the limit: tried once, marked, never the winner
    over = [t for t in r.trials if t.settings.micro_rows == 16]
    assert over and all(t.status == OVER_MEMORY for t in over)
    assert not any(s.gradient_checkpointing for s in m.calls)  # everything fits without it


def test_gains_within_measurement_noise_are_not_taken():
    # every trial's steps spread by 100% of the median over 4 steps: no single change
    # in the cost model (at most 1.3x) is outside two standard errors of the difference
    m = FakeMachine(spread=1.0)
    r = _search(m)
    assert r.best.settings == START and r.speedup == 1.0
    # the start won: measured again at the end, its figure pools both ends of the tune
    assert r.trials[-1].settings == START and r.trials[-1].role == "confirm"
    assert r.best.measurements == sum(t.settings == START for t in r.trials) >= 2
    quiet = _search(FakeMachine(spread=0.01))
    assert quiet.best.settings == OPTIMUM


def test_tokens_per_step_never_change():
    m = FakeMachine()
    r = _search(m)
    assert m.tokens_per_step_seen == {1024}
    assert {t.tokens_per_step for t in r.trials if t.status == OK} == {1024}


@pytest.mark.parametrize("budget", [25.0, 60.0, 95.0])
def test_respects_the_budget_and_returns_the_best_found(budget):
    m = FakeMachine()
    r = _search(m, budget=budget)
    assert m.now <= budget  # no trial (the confirmation included) that could not finish in time
    assert r.stopped == "budget"
    assert r.best.tokens_per_second >= r.baseline.tokens_per_second
    if r.best.settings != START:  # a change was taken: checked, then confirmed
        assert r.confirmed is True and r.best.measurements == 1


def test_budget_below_one_trial_still_measures_the_start():
    m = FakeMachine()
    r = _search(m, budget=1.0)
    assert [t.settings for t in r.trials] == [START]
    assert r.best is r.baseline and r.speedup == 1.0


@pytest.mark.parametrize("message", [None, "CUDA out of memory. Tried to allocate 20.00 MiB"])
def test_out_of_memory_trials_are_caught_and_marked(message):
    m = FakeMachine(raise_oom=True, oom_message=message)
    r = _search(m)
    ooms = [t for t in r.trials if t.status == OOM]
    assert ooms and all(t.settings.micro_rows == 16 for t in ooms)
    assert "out of memory" in ooms[0].error.lower()
    assert r.best.settings == OPTIMUM


def test_gradient_checkpointing_only_when_nothing_fits():
    # 1 row needs 1 + 0.5 = 1.5 GiB > 0.9 x 1.5; with checkpointing 1.2 GiB fits.
    m = FakeMachine(limit_gib=1.5, raise_oom=True, base_gib=1.0)
    start = START.replace(micro_rows=4)
    r = search(SPACE, m, start=start, budget_seconds=10_000, memory_limit_bytes=int(1.5 * GiB),
               clock=m.clock, compile_estimate_seconds=30.0)  # fmt: skip
    assert r.baseline.status == OOM and r.speedup is None
    assert r.best is not None and r.best.settings.gradient_checkpointing
    assert r.best.settings.micro_rows == 1
    first_ckpt = next(i for i, s in enumerate(m.calls) if s.gradient_checkpointing)
    # turned on only after one row per micro-batch had failed without it
    assert any(s.micro_rows == 1 for s in m.calls[:first_ckpt])
    assert not any(s.gradient_checkpointing for s in m.calls[:first_ckpt])


def test_nothing_fits_is_reported():
    m = FakeMachine(limit_gib=0.5, raise_oom=True)
    r = _search(m)
    assert r.best is None and r.stopped == "nothing-fits"
    assert "nothing" in format_report(_report(r))


def test_is_oom_recognises_wrapped_errors():
    assert is_oom(torch.cuda.OutOfMemoryError("x"))
    assert is_oom(RuntimeError("CUDA error: out of memory"))
    assert is_oom(MemoryError())
    try:
        try:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: out of memory")
        except RuntimeError as inner:
            raise ValueError("a worker failed") from inner
    except ValueError as wrapped:
        assert is_oom(wrapped)
    assert not is_oom(ValueError("shape mismatch"))


def test_cached_trials_are_reused_but_the_winner_is_measured_again(tmp_path):
    cache = TrialCache(tmp_path, {"model": "fake"})
    first = FakeMachine()
    _search(first, cache=cache)
    second = FakeMachine()
    r = _search(second, cache=cache)
    assert r.best.settings == OPTIMUM and not r.best.cached  # measured in this run
    assert not r.baseline.cached
    # the start, then the confirmation (start and winner); the rest from cache
    assert second.calls == [START, START, OPTIMUM]
    assert TrialCache(tmp_path, {"model": "other"}).get(OPTIMUM) is None  # keyed by context


@dataclass
class LuckyMachine(FakeMachine):
    """Every setting runs at the same speed, but `lucky` settings measure fast at first.

    `lucky(s)` says whether `s` is lucky; its first `lucky_trials` measurements come out
    1.5x faster (a quiet moment on a shared machine), later ones at the true speed.
    """

    lucky: Any = None
    lucky_trials: int = 1
    seen: dict = field(default_factory=dict)

    def speed(self, s: Settings) -> float:
        n = self.seen.get(s, 0)
        return 1000.0 * (1.5 if self.lucky(s) and n < self.lucky_trials else 1.0)

    def __call__(self, s: Settings) -> TrialResult:
        r = super().__call__(s)
        self.seen[s] = self.seen.get(s, 0) + 1
        return r


def test_one_lucky_trial_does_not_steer_the_search():
    m = LuckyMachine(lucky=lambda s: s.loader_workers == 1)
    r = _search(m)
    assert r.best.settings.loader_workers == 0
    lucky = [t for t in r.trials if t.settings.loader_workers == 1]
    assert lucky[0].tokens_per_second == 1500.0  # it did look faster once...
    assert [t.role for t in lucky] == ["search", "recheck"]  # ...and was checked, not taken
    assert r.speedup == 1.0


def test_confirmation_keeps_the_start_when_the_winner_does_not_hold_up():
    # bucket looks 1.5x faster in its search trial and in its recheck, then never again
    m = LuckyMachine(lucky=lambda s: s.batching == "bucket", lucky_trials=2)
    r = _search(m)
    assert r.confirmed is False
    assert r.rejected is not None and r.rejected.settings.batching == "bucket"
    assert r.best.settings == START and r.speedup == 1.0
    assert [t.settings.batching for t in r.trials if t.role == "confirm"] == ["pack", "bucket"]


def test_the_speedup_survives_a_drift_in_machine_speed():
    plain = FakeMachine()
    _search(plain)
    # the same search, but the machine slows by 30% for the confirmation round (the last two)
    m = FakeMachine(slow_from_call=len(plain.calls) - 2)
    r = _search(m)
    true_ratio = m.speed(OPTIMUM) / m.speed(START)
    assert r.best.settings == OPTIMUM and r.speedup == pytest.approx(true_ratio)
    starts = [t.tokens_per_second for t in r.trials if t.settings == START]
    assert starts[-1] == pytest.approx(0.7 * m.speed(START))  # measured in the slow spell
    # the winner's figure: the start's level over all its trials x the side-by-side ratio
    level = sum(starts) / len(starts)
    assert r.baseline.tokens_per_second == pytest.approx(level)
    assert r.best.tokens_per_second == pytest.approx(level * true_ratio)
    side = r.best.extra["side_by_side"]
    assert side["tokens_per_second"] == pytest.approx(0.7 * m.speed(OPTIMUM))  # kept, not hidden


def test_trial_to_trial_noise_comes_from_repeated_settings():
    def t(s, v, n=1):
        return TrialResult(s, tokens_per_second=v, measurements=n)

    # one setting measured at 100 and 110: log spread d, pooled SD d / sqrt(2)
    groups = [[t(START, 100.0), t(START, 110.0)], [t(OPTIMUM, 200.0)]]
    assert trial_to_trial_noise(groups) == pytest.approx(math.log(1.1) / math.sqrt(2))
    assert trial_to_trial_noise([[t(START, 100.0)], [t(OPTIMUM, 200.0)]]) == 0.0  # no repeat yet
    # it widens the margin a change must beat, less for figures pooled over more trials
    a, b = t(START, 100.0), t(OPTIMUM, 110.0)
    assert noise(a, b) == 0.0 and noise(a, b, 0.05) == pytest.approx(0.05 * math.sqrt(2))
    assert noise(t(START, 100.0, 4), t(OPTIMUM, 110.0, 4), 0.05) == pytest.approx(
        0.05 * math.sqrt(2) / 2
    )


def test_pooled_figure_is_the_median_over_all_steps():
    s = START
    a = TrialResult(s, tokens_per_second=1.0, step_times=[1.0, 1.0, 9.0], step_tokens=[100] * 3)
    b = TrialResult(s, tokens_per_second=1.0, step_times=[2.0, 2.0], step_tokens=[100] * 2)
    p = pool([a, b])
    assert p.step_seconds == 2.0 and p.tokens_per_second == 50.0
    assert p.steps == 5 and p.measurements == 2
    assert pool([a]) is a


def test_median_stability_rule():
    assert median_is_stable([1.0, 1.01, 0.99, 1.0, 1.0], 0.02)
    assert not median_is_stable([1.0, 2.0, 0.5, 1.5, 0.7], 0.02)
    assert not median_is_stable([1.0, 1.0], 0.02)  # too few steps to say


def _report(r) -> TuneReport:
    return TuneReport(r, SPACE, 1024, 6 * GiB, "test")


def test_tuned_yaml_is_a_train_config_with_the_same_tokens_per_step(tmp_path):
    cfg = _cfg()
    assert resolved_tokens_per_step(cfg) == 1024  # 2 rows x 8 accumulation x 64
    r = _search(FakeMachine())
    path = tmp_path / "tuned.yaml"
    tuned = write_tuned_config(cfg, _report(r), path)
    loaded = build_config(load_yaml(path), None, command="train")  # `pitstop train --config`
    assert loaded == tuned
    assert loaded.tokens_per_step == 1024 and loaded.grad_accum is None
    assert loaded.micro_batch_size is None and loaded.tokens_per_micro_batch == 8 * 64
    assert (loaded.batching, loaded.compile, loaded.attention) == ("bucket", "on", "sdpa")
    assert (loaded.loader_workers, loaded.prefetch_factor) == (1, 4)
    assert loaded.output == str(Path(tmp_path / "tuned-run"))
    assert resolved_tokens_per_step(loaded) == resolved_tokens_per_step(cfg)
    text = format_report(_report(r))
    assert "BEST" in text and "baseline" in text and "speed-up" in text
    js = _report(r).to_json()
    assert set(js) >= {"trials", "baseline", "best", "speedup"}
    assert js["best"]["settings"]["tokens_per_micro_batch"] == 512
    assert js["best"]["peak_memory_bytes"] > 0 and js["baseline"]["tokens_per_second"] > 0
    # the machine's load is recorded next to the figures and printed with them
    busy = TuneReport(
        r, SPACE, 1024, 6 * GiB, "test", machine={"load_average_1m": 7.5, "cpu_cores": 2}
    )
    assert "measured with the machine at load 7.5 on 2 cores" in format_report(busy)
    assert busy.to_json()["machine"]["load_average_1m"] == 7.5
    assert set(js["machine"]) == {"load_average_1m", "cpu_cores"}


def test_the_baseline_takes_the_micro_batch_its_run_decided() -> None:
    """A run of the config as written may split its steps otherwise than the config's own
    default (a CPU's larger micro-batch for short rows, a GPU's sized one): the baseline's
    settings are what it ran, so the trials and tuned.yaml compare against that."""
    from pitstop.tune.space import settings_from_choices

    cfg = _cfg(max_seq_len=256, tokens_per_step=2048, micro_batch_size=None, grad_accum=None)
    decided = {"micro_batch": {"value": "8 rows", "reason": "CPU: ..."}}
    assert settings_from_choices(cfg, decided).micro_rows == 8
    assert settings_from_choices(cfg, {"micro_batch": {"value": "default"}}).micro_rows == 2
    assert settings_from_choices(cfg, {}).micro_rows == 2
    set_cfg = _cfg(max_seq_len=256, tokens_per_step=2048, micro_batch_size=4, grad_accum=None)
    assert settings_from_choices(set_cfg, decided).micro_rows == 4  # what the user set wins
