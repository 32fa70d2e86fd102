"""bench/compile_payoff.py's prediction: a compiled run of N steps against N eager steps, the
run's eager measuring steps counted (pitstop.train.compile_record's schedule), and how far
the runs' own clocks are from it."""

from __future__ import annotations

import pytest

from bench.compile_payoff import predicted_saving, summarize
from pitstop.train.compile_record import eager_steps

RECORD = {
    "compile_seconds": 25.0,
    "eager_step_seconds": 1.5,
    "compiled_step_seconds": 1.4,
    "pairs": 11,
    # median 1.0714 (1.5 / 1.4); the 3rd smallest, 1.04, is its 90% bound (11 pairs)
    "ratios": [1.02, 1.03, 1.04, 1.06, 1.07, 1.0714, 1.08, 1.09, 1.10, 1.11, 1.12],
    "speedup_floor": 1.04,
}


def test_the_prediction_counts_the_compile_and_the_eager_measuring_steps() -> None:
    steps = 411
    n_eager = eager_steps(steps)
    # the first, three twos after the compile, then two in every 50 (the second timed)
    assert n_eager == 1 + 2 * 3 + 2 * 7
    # every step but the eager ones saves 0.1 s; the compile costs 25 s
    want = (steps - n_eager) * 0.1 - 25.0
    assert predicted_saving(RECORD, steps) == pytest.approx(want)


def _run(compile_: str, train_s: float) -> dict:
    return {
        "compile": compile_,
        "trained_tokens": 1_000_000,
        "train_seconds": train_s,
        "wall_seconds": train_s + 10,
        "measured": RECORD if compile_ == "on" else None,
        "others_cores": 0.01,
    }


def test_the_summary_gives_the_saving_and_the_compiled_clock_against_the_prediction() -> None:
    steps = 411
    pred = predicted_saving(RECORD, steps)  # 14.0 s
    runs = [_run("off", 620.0), _run("on", 600.0), _run("on", 610.0), _run("off", 630.0)]
    rows, goals = summarize(runs, steps)
    assert len(rows) == 4 and rows[1][5] == "1.500 / 1.400 (11 pairs; 1.04x at 90%)"
    text = "\n".join(goals)
    measured = 625.0 - 605.0
    assert f"predicted a train-clock saving of {pred:.0f} s; the runs measured 20 s" in text
    assert f"{abs(pred - measured) / measured:.0%} off" in text
    want = 625.0 - pred
    assert f"predicted {want:.0f} s, measured 605 s ({abs(want - 605) / 605:.1%} off)" in text
    assert "the eager runs differ by 1.6% among themselves" in text
    # the pairs show a gain (1.04x at 90%), and 411 steps save ~41 s against a 25 s compile
    assert "compile: auto for a run of 411 steps: compile" in text
    assert "1.04x with 90% confidence); over this run's 411 steps it saves ~41 s" in text
