"""`pitstop compare` under noise: steady medians, a noise band, per-token cost.

Two identical pairs of runs, one pair measured on a loaded machine (a slow warm-up step
and jittered steps, as replayed in issue 24), must never give opposite verdicts; runs that
trained different token counts get per-token verdicts and none on totals.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from pitstop.report.compare import DIFFERENT_WORK, NO_DIFFERENCE, compare, format_compare
from pitstop.report.runs import load_run
from pitstop.report.steady import NOISY_FLOOR, steady


def synthetic_run(
    dest: Path,
    *,
    steps: int = 16,
    step_s: float = 1.4,
    tokens: int = 1800,
    warmup_s: float | None = None,
    jitter: float = 0.0,
    seed: int = 0,
    load: float = 0.3,
    mark_warmup: bool = False,
    machine: dict | None = None,
) -> Path:
    """A run dir like PitstopCallback writes: per-step lines (cumulative tokens) + summary."""
    rng = random.Random(seed)
    dest.mkdir(parents=True)
    lines, cum, total = [], 0, 0.0
    for i in range(1, steps + 1):
        secs = step_s * (1 + rng.uniform(-jitter, jitter))
        if i == 1 and warmup_s is not None:
            secs = warmup_s
        cum += tokens
        total += secs
        lines.append({
            "step": i, "warmup": mark_warmup and i == 1, "trained_tokens": cum,
            "step_trained_tokens": tokens, "step_seconds": secs, "data_wait_s": 0.1 * secs,
            "forward_s": 0.3 * secs, "backward_s": 0.5 * secs, "optimizer_s": 0.1 * secs,
        })  # fmt: skip
    (dest / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    summary = {
        "status": "completed", "trained_tokens": cum, "optimizer_steps": steps,
        "train_seconds": total, "wall_seconds": total + 5, "tokens_per_second": cum / total,
        "time_breakdown": {"data_wait": 0.1 * total, "forward": 0.9 * total},
        "machine": machine or {"load_average_1m": load, "cpu_cores": 2},
    }  # fmt: skip
    (dest / "summary.json").write_text(json.dumps(summary))
    return dest


def verdicts(res: dict) -> dict[str, str | None]:
    return {r["metric"]: r["verdict"] for r in res["metrics"]}


OPPOSITE = {("better", "worse"), ("worse", "better")}


@pytest.mark.parametrize("seed", range(6))
def test_identical_pairs_quiet_and_loaded_never_disagree(tmp_path: Path, seed: int) -> None:
    # Quiet pair: the same loop twice. Loaded pair: the same loop while another job runs,
    # one run with an 8.7 s warm-up step against a 1.4 s median (issue 24's numbers).
    qa = synthetic_run(tmp_path / "qa", jitter=0.02, seed=seed)
    qb = synthetic_run(tmp_path / "qb", jitter=0.02, seed=seed + 100)
    la = synthetic_run(tmp_path / "la", jitter=0.3, seed=seed + 200, load=3.5)
    lb = synthetic_run(tmp_path / "lb", jitter=0.3, seed=seed + 300, load=3.5, warmup_s=8.7)
    quiet, loaded = verdicts(compare(qa, qb, 2.0)), verdicts(compare(la, lb, 2.0))
    for key in quiet:
        assert (quiet[key], loaded[key]) not in OPPOSITE, key
    # Identical work, identical loop: neither pair may call the speed better or worse.
    assert quiet["tokens_per_second"] == NO_DIFFERENCE
    assert loaded["tokens_per_second"] == NO_DIFFERENCE
    # Whole-run totals would have said "better" by 1.5x for the loaded pair; steady, no.
    assert loaded["train_seconds"] in (NO_DIFFERENCE, "worse")


def test_warmup_left_out_and_said(tmp_path: Path) -> None:
    run = load_run(synthetic_run(tmp_path / "r", warmup_s=8.7))
    st = steady(run)
    # not marked: the first DEFAULT_WARMUP (2) steps are left out
    assert st is not None and st.warmup == 2 and st.steps == 14
    assert st.step_seconds == pytest.approx(1.4)
    marked = steady(load_run(synthetic_run(tmp_path / "m", warmup_s=8.7, mark_warmup=True)))
    assert marked is not None and marked.warmup == 1
    text = format_compare(compare(tmp_path / "r", tmp_path / "m"))
    assert (
        "A: tokens over seconds of 14 steady steps, stalls included (2 warm-up step(s) left out)"
        in text
    )
    assert (
        "B: tokens over seconds of 15 steady steps, stalls included (1 warm-up step(s) left out)"
        in text
    )


def test_compare_and_estimate_leave_out_the_same_warmup_steps(tmp_path: Path) -> None:
    from pitstop.report.measured import load_measured

    for mark in (False, True):  # first step marked (PitstopCallback), or not (pitstop train)
        d = synthetic_run(tmp_path / f"r{mark}", warmup_s=8.7, mark_warmup=mark)
        st = steady(load_run(d))
        rate = load_measured(d).steady
        assert st is not None and rate is not None
        assert st.warmup == (1 if mark else 2)
        assert f"mean of {st.steps} steps after {st.warmup} warm-up steps" in rate.detail
        assert rate.tokens_per_second == pytest.approx(1800 / 1.4)


def test_noisy_run_is_flagged_in_the_table_and_widens_the_band(tmp_path: Path) -> None:
    a = synthetic_run(tmp_path / "a")
    b = synthetic_run(tmp_path / "b", load=3.5, jitter=0.5, seed=1)
    res = compare(a, b)
    assert res["noise_band"][1] >= 1 + NOISY_FLOOR - 1e-9
    assert res["steady"]["b"]["noisy"] and not res["steady"]["a"]["noisy"]
    text = format_compare(res)
    assert "NOISY: " in text and "load 3.5 on 2 cores" in text
    assert "noisy machine" in text  # the note saying how to settle it


def test_a_steadily_shared_run_is_flagged_though_its_steps_are_even(tmp_path: Path) -> None:
    # Another job held one of the two cores throughout: every step equally slow, load 1.9
    # (under the cores), so only the measured CPU time of other processes shows it.
    shared = {"load_average_1m": 1.9, "cpu_cores": 2, "other_cores": 1.0, "steal_cores": 0.0,
              "window_seconds": 30.0, "machine_cores": 2}  # fmt: skip
    a = synthetic_run(tmp_path / "a", jitter=0.02)
    b = synthetic_run(tmp_path / "b", jitter=0.02, seed=1, machine=shared)
    res = compare(a, b)
    assert res["steady"]["b"]["noisy"] == ["other processes used 1.0 of 2 cores"]
    assert not res["steady"]["a"]["noisy"] and res["noise_band"][1] >= 1 + NOISY_FLOOR - 1e-9


def test_a_real_speedup_beyond_the_band_is_called(tmp_path: Path) -> None:
    a = synthetic_run(tmp_path / "a", step_s=1.4, jitter=0.05)
    b = synthetic_run(tmp_path / "b", step_s=0.7, jitter=0.05, seed=3)
    v = verdicts(compare(a, b, 2.0))
    assert v["tokens_per_second"] == "better"
    assert v["train_seconds"] == "better" and v["cost_per_mtok"] == "better"


def test_unequal_trained_tokens_per_token_cost_no_better_on_totals(tmp_path: Path) -> None:
    # B trained fewer tokens (issue 24: 28,239 against 58,305) in less time, at a worse
    # cost per token: the totals must not be called better.
    a = synthetic_run(tmp_path / "a", steps=16, tokens=3644)
    b = synthetic_run(tmp_path / "b", steps=16, tokens=1765, step_s=0.9)
    res = compare(a, b, 2.0)
    v = verdicts(res)
    for total in ("train_seconds", "wall_seconds", "cost"):
        assert v[total] == DIFFERENT_WORK
    assert v["cost_per_mtok"] == "worse"
    assert v["tokens_per_second"] == "worse"
    assert "different numbers of tokens" in " ".join(res["notes"])
    assert "(better)" not in format_compare(res)
