"""SIGKILL at many moments, then `--resume`: the result is bit-identical to a run never killed.

Each kill lands at a named fault point (pitstop/core/faults.py: the process SIGKILLs itself
there, as a kill from outside would), never at a wall-clock guess, so a loaded machine
gives the same answer as an idle one: in a step, while a checkpoint is being written
(its files written, not its COMPLETE marker), right after a checkpoint directory is
renamed into place, or at start-up (before anything loads, after the batch layout is
decided and recorded, after a checkpoint is restored). After every kill, each
checkpoint that discovery accepts must load completely (weights, optimizer, state,
RNG, loader), so a half-written checkpoint can never be resumed from. The fast
variants run in CI; the soak (`-m soak`, `make soak`) kills 20+ times at points and
steps drawn from a seeded RNG, adds kills at random moments ("anywhere") for what no
named point covers, and prints the seed and every kill so a failure can be replayed.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from _rel import (
    BASE_STEPS,
    KILLED,
    SAVE_STEPS,
    assert_same_as,
    check_accepted_checkpoints,
    die_at,
    metric_lines,
    no_traceback,
    reference_run,
    run,
    sigkill,
    start,
    train_cmd,
    wait_until,
)

MODES = ("step", "write", "rename", "startup")
STARTUP_POINTS = ("startup", "measured", "restored")  # pitstop/core/faults.py POINTS


def default_cmd(
    model: Path, store: Path, out: Path, *extra: str, steps: int = BASE_STEPS
) -> list[str]:
    """train_cmd under the default settings: batching auto, default tokens per step and micro-batch."""
    cmd = train_cmd(model, store, out, *extra, steps=steps)
    for flag in ("--tokens-per-step", "--micro-batch-size", "--batching"):
        i = cmd.index(flag)
        del cmd[i : i + 2]
    return cmd


def fault_point(mode: str, base: int, steps: int, rng: random.Random) -> tuple[str, int | None]:
    """(the fault point, the step or checkpoint it names) for a kill of kind `mode` in a
    life resumed from checkpoint `base` (0: none). Every point returned is reached."""
    # In-loop saves happen at multiples of SAVE_STEPS below the last step; the last
    # step's checkpoint is written by the final save.
    future = [s for s in range(base + SAVE_STEPS, steps, SAVE_STEPS)] or [steps]
    target = rng.choice(future[:2])
    if mode == "write" and target < steps:
        return "ckpt-write", target
    if mode in ("write", "rename"):
        return "ckpt-renamed", target
    if mode == "step":
        return "step", min(base + rng.randint(1, 3), steps)
    if mode == "startup":  # "restored" only where there is a checkpoint to restore
        mode = rng.choice(STARTUP_POINTS if base else STARTUP_POINTS[:2])
    if mode == "restored" and not base:
        mode = "measured"
    assert mode in STARTUP_POINTS, mode
    return mode, None


def _kill_once(
    model: Path,
    store: Path,
    out: Path,
    steps: int,
    mode: str,
    rng: random.Random,
    cmd_fn: Callable[..., list[str]] = train_cmd,
) -> dict:
    """Start a resuming run that dies at the point `mode` names; check what is on disk."""
    ckpts = out / "checkpoints"
    base = max(check_accepted_checkpoints(out), default=0)
    cmd = cmd_fn(model, store, out, "--resume", steps=steps)
    if mode == "anywhere":  # soak only: a kill at a moment no fault point names
        return _kill_anywhere(cmd, out, base, rng)
    point, target = fault_point(mode, base, steps, rng)
    where = point if target is None else f"{point}:{target}"
    r = run(cmd, **die_at(where))
    accepted = check_accepted_checkpoints(out)
    event = {"point": where, "resumed_from": base, "accepted": accepted,
             "finished_before_kill": r.returncode != KILLED}  # fmt: skip
    # Every named point is reached: a run that ended any other way is a failure.
    assert r.returncode == KILLED, (event, r.stderr[-3000:])
    if point == "ckpt-write":
        partial = list(ckpts.glob(f".step-{target}.partial-*"))
        assert partial and (partial[0] / "model.safetensors").is_file(), event
        assert target not in accepted, f"a half-written checkpoint was accepted: {event}"
    if point == "ckpt-renamed":
        assert target in accepted, event
    if point == "step":
        assert not accepted or max(accepted) < target, event
    return event


def _kill_anywhere(cmd: list[str], out: Path, base: int, rng: random.Random) -> dict:
    """SIGKILL at a random moment after the life's first new metrics line (soak only)."""
    metrics = out / "metrics.jsonl"
    old_inode = metrics.stat().st_ino if metrics.exists() else None

    def cond() -> bool:
        # The resumed process rewrites metrics.jsonl (new inode) before its first step,
        # so lines left by the previous life are not mistaken for progress.
        if not metrics.exists() or metrics.stat().st_ino == old_inode:
            return False
        lines = metric_lines(out)
        return bool(lines) and lines[-1]["step"] > base

    proc = start(cmd)
    try:
        wait_until(cond, proc, "a step")
        time.sleep(rng.uniform(0, 0.3))
        finished = proc.poll()
    finally:
        sigkill(proc)
    event = {"point": "anywhere", "resumed_from": base,
             "accepted": check_accepted_checkpoints(out),
             "finished_before_kill": finished is not None}  # fmt: skip
    assert finished in (None, 0), event
    return event


def crash_campaign(model: Path, store: Path, out: Path, ref: Path | None, *, steps: int,
                   modes: list[str], rng: random.Random,
                   cmd_fn: Callable[..., list[str]] = train_cmd) -> list[dict]:  # fmt: skip
    """Kill at each of `modes`, resume to the end, compare with `ref` (None: run it afterwards,
    beside `out`, so it shares the cache and the measured choices as a rerun would)."""
    events = []
    for mode in modes:
        ev = _kill_once(model, store, out, steps, mode, rng, cmd_fn)
        events.append(ev)
        print(ev)
        if ev["finished_before_kill"]:
            break
    done = run(cmd_fn(model, store, out, "--resume", steps=steps))
    assert done.returncode == 0, done.stderr[-3000:]
    no_traceback(done.stderr)
    if ref is None:
        ref = out.parent / "ref"
        r = run(cmd_fn(model, store, ref, steps=steps))
        assert r.returncode == 0, r.stderr[-3000:]
        assert "reused, measured" in r.stderr or cmd_fn is train_cmd, r.stderr[-3000:]
    assert_same_as(out, ref, steps)
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]
    return events


@pytest.mark.slow
def test_sigkill_during_step_write_and_after_rename_then_resume(
    tiny_model_dir, rel_store, reference, tmp_path
):
    rng = random.Random(1234)
    events = crash_campaign(
        tiny_model_dir, rel_store, tmp_path / "out", reference, steps=BASE_STEPS,
        modes=["write", "step", "rename"], rng=rng,
    )  # fmt: skip
    assert [e["point"].split(":")[0] for e in events] == ["ckpt-write", "step", "ckpt-renamed"]


@pytest.mark.slow
def test_sigkill_inside_a_checkpoint_write_keeps_the_previous_one_newest(
    tiny_model_dir, rel_store, reference, tmp_path
):
    """The run SIGKILLs itself inside its step-4 checkpoint write, after the weights are
    written and before the marker: the partial holds the weights, yet step-2 stays the newest
    checkpoint; `--resume` removes the partial and ends bit-identical to the run never killed.
    (It was tests/test_train_run.py's, with a reference run of its own: issue 45.)"""
    from pitstop.train.checkpoint import latest_checkpoint

    out = tmp_path / "out"
    killed = run(train_cmd(tiny_model_dir, rel_store, out), **die_at("ckpt-write:4"))
    assert killed.returncode == KILLED, killed.stderr[-3000:]
    partial = next((out / "checkpoints").glob(".step-4.partial-*"))
    assert (partial / "model.safetensors").is_file()  # the weights were already written...
    assert latest_checkpoint(out / "checkpoints").name == "step-2"  # ...but it is not taken
    done = run(train_cmd(tiny_model_dir, rel_store, out, "--resume"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert not partial.exists()
    assert_same_as(out, reference)


@pytest.mark.slow
def test_sigkill_under_default_settings_then_resume(tiny_model_dir, rel_store, tmp_path):
    """Default settings (batching auto): kills right after the measurement, in a step,
    mid-write, right after a restore and after a rename; the run ends bit-identical to
    an uninterrupted one.

    The first life measures the layout (no cache yet) and records it in the run directory
    before its first step; every resume takes it from there. The uninterrupted run is a
    second start of the same config: it reuses the cached measurement.
    """
    rng = random.Random(4321)
    events = crash_campaign(
        tiny_model_dir, rel_store, tmp_path / "out", None, steps=BASE_STEPS,
        modes=["measured", "step", "write", "restored", "rename"], rng=rng, cmd_fn=default_cmd,
    )  # fmt: skip
    # Five lives, each killed where it was told ("restored" becomes "measured" in a life
    # with no complete checkpoint to restore yet).
    assert len(events) == 5 and events[0]["point"] == "measured", events
    rec = json.loads((tmp_path / "out" / "choices.json").read_text(encoding="utf-8"))
    summary = json.loads((tmp_path / "out" / "summary.json").read_text(encoding="utf-8"))
    assert summary["choices"]["batching"]["value"] == rec["values"]["batching"]
    assert summary["measured_choices"]["source"] == "run"


SOAK_KILLS = int(os.environ.get("PITSTOP_SOAK_KILLS", "20"))
SOAK_SEED = int(os.environ.get("PITSTOP_SOAK_SEED", "20240601"))
SOAK_STEPS = 60


@pytest.mark.soak
def test_soak_many_sigkills_then_resume(tiny_model_dir, rel_store, tmp_path):
    """At least SOAK_KILLS kills at moments drawn from a seeded RNG (PITSTOP_SOAK_SEED replays)."""
    ref = reference_run(tmp_path / "ref", tiny_model_dir, rel_store, SOAK_STEPS)
    rng = random.Random(SOAK_SEED)
    modes = [rng.choice((*MODES, "anywhere")) for _ in range(SOAK_KILLS)]
    print(f"soak seed {SOAK_SEED}: {modes}")
    events = crash_campaign(
        tiny_model_dir, rel_store, tmp_path / "out", ref, steps=SOAK_STEPS, modes=modes, rng=rng
    )
    kills = sum(not e["finished_before_kill"] for e in events)
    assert kills >= SOAK_KILLS, f"the run finished after {kills} kills; raise SOAK_STEPS"


def test_a_run_killed_before_its_first_checkpoint_resumes(
    tiny_model_dir, rel_store, tmp_path, reference
):
    """A run killed in its second step leaves pitstop's own config.yaml, metrics.jsonl and
    lock but no run marker: they are told from a user's files by their content
    (pitstop/core/run_files.py), so `--resume` goes on as before instead of refusing."""
    from pitstop.core import run_files, run_record

    out = tmp_path / "out"
    killed = run(train_cmd(tiny_model_dir, rel_store, out), **die_at("step:2"))
    assert killed.returncode == KILLED, killed.stderr[-3000:]
    left = {p.name for p in out.iterdir()}
    assert not left & set(run_record.RUN_MARKERS), left
    assert {run_record.CONFIG, ".lock"} <= left, left
    assert run_files.foreign_files(out) == []
    done = run(train_cmd(tiny_model_dir, rel_store, out, "--resume"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_as(out, reference)
