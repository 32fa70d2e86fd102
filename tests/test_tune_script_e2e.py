"""`pitstop tune -- CMD` end to end on real scripts (issue 31's "Done when"), on CPU.

- the seed-002-shaped plain loop (examples/custom_loop.py: batch 1, `num_workers=0`, a slow
  `__getitem__`): the loader fix is found, measured >= 1.5x outside the band, and printed as
  DataLoader arguments;
- a loop with nothing to fix from outside (pre-tokenized, so loader workers can only add
  overhead): the workers the doctor proposes are measured, and "no change beats the noise";
- a Trainer script (examples/hf_trainer_loop.py: fp32, checkpointing on, saves into its
  --output-dir): the trials leave the user's output_dir, checkpoints and logs untouched, and
  bf16 is not tried on a CPU without native bf16.

Slow (each trial is a Python process that loads torch and a tiny model).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pitstop import cli
from pitstop.probe import cpu_has_bf16
from pitstop.tune.script import FASTER, SAME_SPEED, SLOWER, TUNED

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def one_omp_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Trials run with OMP_NUM_THREADS=1. On the shared 2-core machine, the script's two
    OpenMP threads and its loader workers oversubscribe the cores, and OpenMP's spinning
    barriers made each step's compute up to 10x slower in some trials and not in others
    (conftest.one_thread says the same of in-process tests): a 2x loader fix then read as
    anything from 0.5x to 4.6x. A user's machine with cores to spare does not need this."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _tune(out: Path, script: str, *args: str, steps: int = 6, budget: int = 600) -> dict:
    argv = ["tune", "--output", str(out), "--steps", str(steps), "--budget-seconds", str(budget)]
    rc = cli.main([*argv, "--", sys.executable, str(EXAMPLES / script), *args])
    assert rc == 0
    return json.loads((out / TUNED).read_text())


def test_plain_loop_loader_fix_measured(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 12 measured steps per trial: on a machine shared with other busy processes, load comes
    # in bursts of seconds, and shorter trials read a burst as the setting's effect. 0.15 s
    # per item (a baseline trial measures ~2 s): the best worker count still measured 4.9x
    # [3.6-6.7] on a busy 2-core machine, far from the 1.5x asserted.
    res = _tune(
        tmp_path / "t",
        "custom_loop.py",
        str(tiny_model_dir),
        "--sleep",
        "0.15",
        "--steps",
        "1000",
        steps=12,
    )
    out = capsys.readouterr().out
    workers = [r for r in res["results"] if r["fix"].startswith("num_workers=")]
    assert workers, res
    best = max(workers, key=lambda r: (r["judgement"] or {}).get("ratio", 0))
    assert best["verdict"] == FASTER, best
    j = best["judgement"]
    assert j["ratio"] >= 1.5 and j["low"] > 1.0, j  # the gain, outside the band
    assert res["dataloader_kwargs"]["num_workers"] >= 1
    assert "DataLoader(..., num_workers=" in out and "winning settings" in out
    assert res["combined"] is not None and res["combined"]["verdict"] == FASTER
    # Every trial is a run directory: the script stopped after warm-up + K steps.
    for run in best["runs"]:
        steps = (Path(run) / "metrics.jsonl").read_text().splitlines()
        assert len(steps) == 12 + 2


def test_nothing_to_fix_says_no_change_beats_the_noise(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Pre-tokenized: __getitem__ hands back tensors, so no loader setting can help; the doctor
    # still proposes workers for the loop's 0 (loader-main-process) and tune measures them.
    # (It was a tokenizing __getitem__ with 2 workers: on a busy 2-core machine that loop can
    # still wait for data, so a third worker may really help, and once measured faster.)
    # 30 measured steps (~1.5 s of ~50 ms steps): a burst of another process's load then
    # falls inside a trial, where it widens that pair's band, rather than on a whole trial.
    res = _tune(
        tmp_path / "t",
        "custom_loop.py",
        str(tiny_model_dir),
        "--pretokenize",
        "--steps",
        "100",
        steps=30,
    )
    workers = [r for r in res["results"] if r["fix"].startswith("num_workers=")]
    assert workers, res  # a candidate was measured, not just an empty plan
    for r in workers:
        assert r["verdict"] in (SAME_SPEED, SLOWER), r
    assert res["dataloader_kwargs"] == {} and res["combined"] is None
    assert "no change beats the noise" in capsys.readouterr().out


def test_trainer_trials_leave_the_users_files_alone(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    user = tmp_path / "user"
    user.mkdir()
    (user / "keep.txt").write_text("the user's")
    res = _tune(
        tmp_path / "t",
        "hf_trainer_loop.py",
        str(tiny_model_dir),
        "--output-dir",
        str(user / "out"),
        "--sleep",
        "0.05",
        steps=4,
        budget=40,  # the baseline and a first trial: what the user's files must survive
    )
    # No checkpoint, no log, no saved model in the user's output_dir: nothing at all.
    assert sorted(p.name for p in user.iterdir()) == ["keep.txt"]
    base = Path(res["baseline"])
    applied = json.loads((base / "applied.json").read_text())
    assert applied["trainer"] and applied["script_args"]["output_dir"] == str(user / "out")
    assert Path(applied["training_args"]["output_dir"]).is_relative_to(base)
    assert applied["training_args"]["save_strategy"] == "no"
    assert applied["stopped_after_steps"] == 4 + 2
    fixes = [r["fix"] for r in res["results"]]
    assert "gradient_checkpointing=False" in fixes
    if not cpu_has_bf16():
        assert "bf16=True" not in fixes
        assert any(n["fix"] == "bf16" for n in res["not_tried"])
    assert "TrainingArguments(" in capsys.readouterr().out or not res["training_args"]
