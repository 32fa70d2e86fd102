"""One writer per run directory: OUT/.lock (flock) is held for the whole run.

A second `pitstop train` on the same --output (a plain start, or --resume as a job
scheduler's requeue does) fails at once naming the holder, and the first run is left
alone; the kernel drops the lock when its holder dies; readers never take it.
"""

from __future__ import annotations

import json
import os
import socket

import pytest
from _rel import (
    held,
    hold_at,
    metric_lines,
    no_traceback,
    release,
    sigkill,
    start,
    train_cmd,
    wait_until,
)

from pitstop.core import runlock as lock


def test_second_acquire_names_the_holder(tmp_path):
    out = tmp_path / "out"
    with lock.acquire(out):
        with pytest.raises(lock.RunInProgress) as e:
            lock.acquire(out)
        assert f"run in progress (pid {os.getpid()}, host {socket.gethostname()})" in str(e.value)
        assert lock.holder(out) == f"pid {os.getpid()}, host {socket.gethostname()}"
    assert lock.holder(out) is None  # released: the next writer gets in
    lock.acquire(out).release()


def test_ranks_of_the_launcher_holding_it_pass(tmp_path, monkeypatch):
    """--nproc: the launcher holds the lock; the ranks it started (PITSTOP_RUN_LOCK) pass."""
    out = tmp_path / "out"
    with lock.acquire(out):
        monkeypatch.setenv(lock.HELD_ENV, str(os.getpid()))
        assert lock.holder(out) is None
        lock.acquire(out).release()  # a no-op lock: the launcher's stays held
        monkeypatch.setenv(lock.HELD_ENV, "1")  # another process's: still refused
        with pytest.raises(lock.RunInProgress):
            lock.acquire(out)


@pytest.mark.slow
def test_second_writer_fails_at_once_and_the_first_finishes(
    tiny_model_dir, rel_store, tmp_path, capsys
):
    from pitstop.cli import main

    out = tmp_path / "out"
    cmd = train_cmd(tiny_model_dir, rel_store, out)
    # The first run holds inside its step-4 checkpoint write until released: it is still
    # running below, however slow the machine.
    gate = tmp_path / "gate"
    first = start(cmd, **hold_at("ckpt-write:4", gate))
    try:
        assert wait_until(lambda: held(gate), first, "the step-4 write")
        holder = f"run in progress (pid {first.pid}, host {socket.gethostname()})"
        capsys.readouterr()
        for extra in ([], ["--resume"], ["--overwrite"]):
            rc = main([*cmd[3:], *extra])  # in this process: refused before any import cost
            err = capsys.readouterr().err
            assert rc in (1, 2), err[-2000:]
            no_traceback(err)
            assert holder in err, err[-2000:]
        # Readers need no lock: the run's files are readable while it trains.
        assert metric_lines(out)
        release(gate)
        _, err = first.communicate(timeout=240)
        assert first.returncode == 0, err[-3000:]
    finally:
        sigkill(first)
    lines = metric_lines(out)
    assert [r["step"] for r in lines] == list(range(1, 9)), "the second writers wrote steps"
    assert json.loads((out / "summary.json").read_text())["status"] == "completed"


@pytest.mark.slow
def test_a_killed_holder_leaves_no_stale_lock(tiny_model_dir, rel_store, tmp_path):
    out = tmp_path / "out"
    gate = tmp_path / "gate"  # never released: the run holds at its step-2 write until killed
    first = start(train_cmd(tiny_model_dir, rel_store, out), **hold_at("ckpt-write:2", gate))
    try:
        assert wait_until(lambda: held(gate), first, "the step-2 write")
        assert lock.holder(out) is not None
    finally:
        sigkill(first)
    assert lock.holder(out) is None
    lock.acquire(out).release()
