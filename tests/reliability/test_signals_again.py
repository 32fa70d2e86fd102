"""SIGINT, SIGTERM and SIGKILL where no test had sent them, then the same command again.

`pitstop prepare` mid-write, `pitstop train --batching auto` around its first-step
measurements (before: `startup`; after they are recorded: `measured`), the final save
(`final-write`: final/'s files written, not yet renamed), and `pitstop tune` inside a
trial. Each time: no stale lock refuses the rerun, nothing half-written looks complete
(a store without its manifest, a final/ or a tuned.yaml), no process is left behind, and
the rerun works. Signals land at named fault points (docs/fault-injection.md), except in
prepare, which has none: there the test waits until the store's partial directory holds
data, which a prepare of 20,000 records reaches long before it ends.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _rel import (
    KILLED,
    assert_same_as,
    check_accepted_checkpoints,
    die_at,
    env,
    held,
    hold_at,
    no_traceback,
    release,
    run,
    sigkill,
    start,
    train_cmd,
    wait_until,
)

pytestmark = pytest.mark.slow
SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGKILL]
IDS = ["SIGINT", "SIGTERM", "SIGKILL"]
# Variants that take a path another case already takes run with `make soak` only: each
# costs two CLI processes (~25 s on the 2-core box) and the suite must stay under ~10 min.
SOAK = pytest.mark.soak


def _stop(proc: subprocess.Popen, sig: signal.Signals, gate: Path | None = None) -> str:
    proc.send_signal(sig)
    if gate is not None:
        release(gate)
    try:
        _, err = proc.communicate(timeout=240)
    finally:
        sigkill(proc)
    return err


# --- prepare ------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    r = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in r.stdout.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


@pytest.fixture(scope="module")
def big_jsonl(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("prep") / "big.jsonl"
    with p.open("w") as f:
        for i in range(20000):
            f.write(json.dumps({"text": f"record {i} " + "word " * 60}) + "\n")
    return p


@pytest.mark.parametrize("sig", SIGNALS, ids=IDS)
def test_prepare_signal_mid_write_then_rerun(sig, tiny_model_dir, big_jsonl, tmp_path):
    cache = tmp_path / "cache"
    cmd = [sys.executable, "-m", "pitstop", "prepare", "--model", str(tiny_model_dir),
           "--data", str(big_jsonl), "--cache-dir", str(cache), "--max-seq-len", "64",
           "--workers", "2"]  # fmt: skip
    # stderr to a file, not a pipe: orphaned workers would hold a pipe open, and reading
    # it to its end would wait for them.
    log = tmp_path / "prepare.err"
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=f)
    stores = cache / "stores"

    def writing() -> bool:
        return any(
            (p / "tokens.bin").is_file() and (p / "tokens.bin").stat().st_size > 50_000
            for p in stores.glob("*.partial-*")
        )

    workers: list[int] = []
    try:
        assert wait_until(writing, proc, "the store's first tokens"), "prepare ended first"
        workers = _children(proc.pid)
        proc.send_signal(sig)
        proc.wait(120)
    finally:
        sigkill(proc)
    deadline = time.monotonic() + 5  # SIGINT: the pool is shut down before the exit
    while [w for w in workers if _alive(w)] and time.monotonic() < deadline:
        time.sleep(0.1)
    orphans = [w for w in workers if _alive(w)]
    for w in orphans:  # killed before any assertion: never left to the next test
        os.kill(w, signal.SIGKILL)
    err = log.read_text()
    assert proc.returncode in (130, 143, -signal.SIGTERM, KILLED), err[-3000:]
    no_traceback(err)
    assert not [p for p in stores.iterdir() if (p / "manifest.json").exists()], (
        "a killed prepare published a store"
    )
    assert not orphans, f"tokenizer workers {orphans} outlived the prepare"
    again = run(cmd)
    assert again.returncode == 0, again.stderr[-3000:]
    # A SIGKILLed prepare cannot remove its partial directory; it never opens as a store
    # (no manifest), and the rerun removes it (its writer's pid is dead, its lock free).
    (store,) = stores.iterdir()
    from pitstop.data.store import TokenStore

    assert len(TokenStore(store)) > 20000  # whole, checksums verified


# --- train: around the first-step measurements -----------------------------------------


def _auto_cmd(model: Path, store: Path, out: Path) -> list[str]:
    cmd = train_cmd(model, store, out, steps=2)
    cmd[cmd.index("--batching") + 1] = "auto"
    i = cmd.index("--micro-batch-size")
    del cmd[i : i + 2]  # sized by the first-step measurement
    cmd[cmd.index("--cache-dir") + 1] = str(out.parent / "cache")  # measured afresh
    return cmd


@pytest.mark.parametrize(
    ("point", "sig"),
    [
        pytest.param("measured", signal.SIGINT, marks=SOAK),  # KeyboardInterrupt, as SIGTERM
        ("measured", signal.SIGTERM),
        ("measured", signal.SIGKILL),
        pytest.param("startup", signal.SIGKILL, marks=SOAK),
    ],
    ids=[f"measured-{i}" for i in IDS] + ["startup-SIGKILL"],
)
def test_train_signal_around_the_first_step_measurements_then_rerun(
    point, sig, tiny_model_dir, rel_store, tmp_path
):
    out, gate = tmp_path / "out", tmp_path / "gate"
    cmd = _auto_cmd(tiny_model_dir, rel_store, out)
    proc = start(cmd, **hold_at(point, gate))
    try:
        assert wait_until(lambda: held(gate), proc, point)
        err = _stop(proc, sig, gate)
    finally:
        sigkill(proc)
    no_traceback(err)
    assert proc.returncode in (130, 143, -signal.SIGTERM, KILLED), err[-3000:]
    assert not (out / "final").exists()
    # The measured choices a rerun reads back are whole JSON or absent.
    for p in [*out.glob("choices.json"), *(tmp_path / "cache").glob("*.json")]:
        json.loads(p.read_text(encoding="utf-8"))
    again = run(cmd)  # the same command: no stale lock, nothing half-written in the way
    assert again.returncode == 0, again.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    assert s["status"] == "completed" and s["optimizer_steps"] == 2


# --- train: SIGKILL during the final save ------------------------------------------------


def test_sigkill_during_the_final_save_then_resume(tiny_model_dir, rel_store, reference, tmp_path):
    """final/'s files are written but not renamed into place when the process dies.

    The fault point makes the moment exact whatever the model's size: a large model's
    seconds-long save only widens the window this test hits every time.
    """
    out = tmp_path / "out"
    cmd = train_cmd(tiny_model_dir, rel_store, out)
    killed = run(cmd, **die_at("final-write"))
    assert killed.returncode == KILLED, killed.stderr[-3000:]
    assert not (out / "final").exists(), "a final/ that is not whole must not exist"
    assert [p.name for p in out.iterdir() if p.name.startswith(".final.partial-")]
    steps = check_accepted_checkpoints(out)  # whatever was accepted loads whole
    assert steps and steps[-1] <= 8
    done = run([*cmd, "--resume"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_as(out, reference)
    assert not [p.name for p in out.iterdir() if ".partial-" in p.name], "debris left"


# --- tune ------------------------------------------------------------------------------


def _tune_cmd(model: Path, store: Path, d: Path) -> list[str]:
    cmd = train_cmd(model, store, d / "run", steps=4)
    cmd[3] = "tune"
    cmd[cmd.index("--output") + 1] = str(d / "tuned.yaml")
    cmd[cmd.index("--cache-dir") + 1] = str(d / "cache")
    i = cmd.index("--max-steps")
    del cmd[i : i + 2]
    return [*cmd, "--budget-seconds", "1", "--trial-steps", "3", "--trial-warmup", "1",
            "--knobs", "micro_batch"]  # fmt: skip


@pytest.mark.parametrize(
    "sig",
    [signal.SIGINT, pytest.param(signal.SIGTERM, marks=SOAK), signal.SIGKILL],  # SIGTERM: as SIGINT
    ids=IDS,
)
def test_tune_signal_inside_a_trial_then_rerun(sig, tiny_model_dir, rel_store, tmp_path):
    tmp = tmp_path / "tmp"  # the trials' temporary directories land here (TMPDIR)
    tmp.mkdir()
    gate = tmp_path / "gate"
    cmd = _tune_cmd(tiny_model_dir, rel_store, tmp_path)
    proc = start(cmd, TMPDIR=str(tmp), **hold_at("step:2", gate))
    try:
        assert wait_until(lambda: held(gate), proc, "a trial's step 2")
        err = _stop(proc, sig, gate)
    finally:
        sigkill(proc)
    assert not (tmp_path / "tuned.yaml").exists(), "a stopped tune wrote its result"
    if sig != signal.SIGKILL:
        # Before: the trial's trainer took the signal, the trial was recorded as failed
        # and the tune went on to write tuned.yaml and exit 0.
        assert proc.returncode == 128 + sig, err[-3000:]
        no_traceback(err)
        assert f"{sig.name} stopped the tune: no tuned config was written" in err, err[-2000:]
        assert not list(tmp.glob("pitstop-tune-*")), "the trial's directory was left"
    else:
        assert proc.returncode == KILLED
        assert list(tmp.glob(f"pitstop-tune-{proc.pid}-*")), "the killed trial's directory"
    again = subprocess.run(cmd, env=env(TMPDIR=str(tmp)), capture_output=True, text=True,
                           timeout=300)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert (tmp_path / "tuned.yaml").is_file()
    assert not list(tmp.glob("pitstop-tune-*")), "a dead tune's trial directory was kept"


# --- profile ---------------------------------------------------------------------------


def test_profile_signal_inside_a_step_names_no_checkpoint(tiny_model_dir, rel_store, tmp_path):
    """SIGINT in `pitstop profile`: the run's checkpoint lived in the scratch directory the
    profile removes, so no "Resume with" pointing at it (before: it named a deleted one)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    gate = tmp_path / "gate"
    cmd = train_cmd(tiny_model_dir, rel_store, tmp_path / "unused", steps=4)
    cmd[3] = "profile"
    cmd[cmd.index("--output") + 1] = str(tmp_path / "p.json")
    i = cmd.index("--max-steps")
    del cmd[i : i + 2]
    proc = start([*cmd, "--steps", "3", "--warmup", "1"], TMPDIR=str(tmp),
                 **hold_at("step:2", gate))  # fmt: skip
    try:
        assert wait_until(lambda: held(gate), proc, "the profile's step 2")
        err = _stop(proc, signal.SIGINT, gate)
    finally:
        sigkill(proc)
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    no_traceback(err)
    assert "before the profile was complete: nothing was written" in err, err[-2000:]
    assert "Resume with" not in err and "checkpoint saved" not in err, err[-2000:]
    assert not (tmp_path / "p.json").exists() and not list(tmp.iterdir())
