"""A child command run with a time limit, ended with every process it started.

`pitstop tune -- CMD` runs the user's script as trials; a script stuck before its first
optimizer step (data loading, a lock, the network) would otherwise keep the tune waiting
forever. The command runs in a session of its own, so that its process group holds what it
started (DataLoader workers, a torchrun launcher's ranks) and one signal reaches them all.
It is ended as `forked_workers.end_workers` ends a pool: SIGTERM first, so that the
processes can go cleanly, then SIGKILL for whatever is left after the same wait.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

from pitstop.core.forked_workers import TERMINATE_WAIT_SECONDS

POLL_SECONDS = 0.05


class TimeLimitReached(Exception):
    """The command was still running at its time limit; its process group was ended."""

    def __init__(self, seconds: float, how: str) -> None:
        super().__init__(f"still running after {seconds:.0f} s; {how}")
        self.seconds = seconds
        self.how = how  # how it was ended, e.g. "stopped it (SIGTERM to its process group)"


def run_with_limit(
    argv: list[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    seconds: float,
    wait: float = TERMINATE_WAIT_SECONDS,
) -> int:
    """Run `argv` in a new session; its exit status. Past `seconds` its process group is
    ended (`end_group`, SIGKILL after `wait` s) and TimeLimitReached raised. An exception
    in the wait (Ctrl-C, a stop signal's handler) ends the group too: the session no longer
    shares the terminal's process group, so the terminal's Ctrl-C would not reach it."""
    proc = subprocess.Popen(argv, env=env, cwd=cwd, start_new_session=True)
    try:
        return proc.wait(timeout=max(0.0, seconds))
    except subprocess.TimeoutExpired:
        raise TimeLimitReached(seconds, end_group(proc, wait)) from None
    except BaseException:
        end_group(proc, wait)
        raise


def end_group(proc: subprocess.Popen[bytes], wait: float = TERMINATE_WAIT_SECONDS) -> str:
    """SIGTERM to the process group `proc` leads; SIGKILL to what is left after `wait`
    seconds. Says what it took. `proc` must lead its group (started in a new session)."""
    pgid = proc.pid
    _signal_group(pgid, signal.SIGTERM)
    end = time.monotonic() + wait
    while time.monotonic() < end:
        if proc.poll() is not None and not group_alive(pgid):
            return "stopped it (SIGTERM to its process group)"
        time.sleep(POLL_SECONDS)
    _signal_group(pgid, signal.SIGKILL)
    proc.wait()
    # SIGKILL is delivered at once but a process takes a moment to go: returned before,
    # the caller could still see the child that ignored SIGTERM.
    end = time.monotonic() + wait
    while group_alive(pgid) and time.monotonic() < end:
        time.sleep(POLL_SECONDS)
    return f"stopped it (SIGTERM to its process group, SIGKILL after {wait:.0f} s)"


def group_alive(pgid: int) -> bool:
    """Whether a live process (not a zombie) is in process group `pgid`. A zombie is left
    out: in a container whose init never reaps, orphans stay zombies, dead all the same."""
    proc = Path("/proc")
    if not proc.is_dir():  # pragma: no cover - not Linux: signal 0 counts zombies too
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            # /proc/PID/stat: "pid (comm) state ppid pgrp ..."; comm may hold spaces.
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                return True
    return False


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone
        os.killpg(pgid, sig)
