"""SIGKILL at many moments, then `--resume`: the result is bit-identical to a run never killed.

A kill may land during a step, while a checkpoint is being written (the test hook
PITSTOP_TEST_CKPT_DELAY holds the write open just before its COMPLETE marker), right
after a checkpoint directory is renamed into place, or while the process is still
starting up and restoring. After every kill, each checkpoint that discovery accepts
must load completely (weights, optimizer, state, RNG, loader), so a half-written
checkpoint can never be resumed from. The fast variant (3 kills, one of each kind that
matters most) runs in CI; the soak (`-m soak`, `make soak`) kills 20+ times at moments
drawn from a seeded RNG, and prints the seed and every kill so a failure can be replayed.
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
    SAVE_STEPS,
    assert_same_as,
    check_accepted_checkpoints,
    no_traceback,
    reference_run,
    run,
    sigkill,
    start,
    train_cmd,
    wait_until,
)

MODES = ("step", "write", "rename", "startup")


def default_cmd(
    model: Path, store: Path, out: Path, *extra: str, steps: int = BASE_STEPS
) -> list[str]:
    """train_cmd under the default settings: batching auto, default tokens per step and micro-batch."""
    cmd = train_cmd(model, store, out, *extra, steps=steps)
    for flag in ("--tokens-per-step", "--micro-batch-size", "--batching"):
        i = cmd.index(flag)
        del cmd[i : i + 2]
    return cmd


def _kill_once(
    model: Path,
    store: Path,
    out: Path,
    steps: int,
    mode: str,
    rng: random.Random,
    cmd_fn: Callable[..., list[str]] = train_cmd,
) -> dict:
    """Start a resuming run, SIGKILL it at the moment `mode` names, check what is on disk."""
    ckpts = out / "checkpoints"
    base = max(check_accepted_checkpoints(out), default=0)
    # In-loop saves happen at multiples of SAVE_STEPS below the last step; the last
    # step's checkpoint is written by the final save.
    future = [s for s in range(base + SAVE_STEPS, steps, SAVE_STEPS)] or [steps]
    target = rng.choice(future[:2])
    env_extra: dict[str, str] = {}
    metrics = out / "metrics.jsonl"
    old_inode = metrics.stat().st_ino if metrics.exists() else None

    if mode == "write" and target < steps:
        env_extra["PITSTOP_TEST_CKPT_DELAY"] = f"{target}:120"

        def cond() -> bool:
            return any(ckpts.glob(f".step-{target}.partial-*/WRITING"))
    elif mode in ("rename", "write"):
        mode = "rename"

        def cond() -> bool:
            return (ckpts / f"step-{target}").is_dir()
    elif mode == "step":
        k = rng.randint(1, 3)

        def cond() -> bool:
            # The resumed process rewrites metrics.jsonl (new inode) before its first step,
            # so lines left by the previous life are not mistaken for progress.
            if not metrics.exists() or metrics.stat().st_ino == old_inode:
                return False
            from _rel import metric_lines

            lines = metric_lines(out)
            return bool(lines) and lines[-1]["step"] >= base + k
    else:  # startup: import, model load, restore, output-dir set-up

        def cond() -> bool:
            return True

    proc = start(cmd_fn(model, store, out, "--resume", steps=steps), **env_extra)
    try:
        wait_until(cond, proc, f"{mode} {target}")
        if mode == "startup":
            time.sleep(rng.uniform(0.2, 8.0))
        elif mode == "step":
            time.sleep(rng.uniform(0, 0.1))
        elif mode == "write":
            time.sleep(rng.uniform(0, 0.3))
        finished = proc.poll()
    finally:
        sigkill(proc)
    accepted = check_accepted_checkpoints(out)
    event = {"mode": mode, "target": target, "resumed_from": base, "accepted": accepted,
             "finished_before_kill": finished is not None}  # fmt: skip
    if finished is not None:
        assert finished == 0, event
        return event
    if mode == "write":
        partial = list(ckpts.glob(f".step-{target}.partial-*"))
        assert partial and (partial[0] / "model.safetensors").is_file(), event
        assert target not in accepted, f"a half-written checkpoint was accepted: {event}"
    if mode == "rename":
        assert target in accepted, event
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
    assert [e["mode"] for e in events] == ["write", "step", "rename"]
    assert not any(e["finished_before_kill"] for e in events)


@pytest.mark.slow
def test_sigkill_under_default_settings_then_resume(tiny_model_dir, rel_store, tmp_path):
    """Default settings (batching auto): kills at start-up (the measurement included), in a
    step, mid-write and after a rename; the run ends bit-identical to an uninterrupted one.

    The first life measures the layout (no cache yet) and records it in the run directory
    before its first step; every resume takes it from there. The uninterrupted run is a
    second start of the same config: it reuses the cached measurement.
    """
    rng = random.Random(4321)
    events = crash_campaign(
        tiny_model_dir, rel_store, tmp_path / "out", None, steps=BASE_STEPS,
        modes=["startup", "step", "write", "startup", "rename"], rng=rng, cmd_fn=default_cmd,
    )  # fmt: skip
    assert sum(not e["finished_before_kill"] for e in events) >= 4
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
    modes = [rng.choice(MODES) for _ in range(SOAK_KILLS)]
    print(f"soak seed {SOAK_SEED}: {modes}")
    events = crash_campaign(
        tiny_model_dir, rel_store, tmp_path / "out", ref, steps=SOAK_STEPS, modes=modes, rng=rng
    )
    kills = sum(not e["finished_before_kill"] for e in events)
    assert kills >= SOAK_KILLS, f"the run finished after {kills} kills; raise SOAK_STEPS"
