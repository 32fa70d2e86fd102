"""`pitstop.core.process_group`: a command past its time limit is ended with every process it
started (`pitstop tune -- CMD`'s trials: a script stuck before its first step, its DataLoader
workers beside it), and none is left behind."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from pitstop.core.process_group import TimeLimitReached, group_alive, run_with_limit

# A parent that starts a child (as a script starts DataLoader workers), writes both pids,
# then waits forever; with IGNORE the child ignores SIGTERM, so only SIGKILL ends it.
SCRIPT = """
import os, signal, subprocess, sys, time
child = "import signal, time\\n"
if sys.argv[2] == "ignore":
    child += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
child += "open(sys.argv[1], 'w').close()\\nwhile True: time.sleep(1)\\n"
ready = sys.argv[1] + ".child"
p = subprocess.Popen([sys.executable, "-c", "import sys\\n" + child, ready])
while not os.path.exists(ready):
    time.sleep(0.01)
with open(sys.argv[1], "w") as f:
    f.write(f"{os.getpid()} {p.pid}")
while True:
    time.sleep(1)
"""


def _alive(pid: int) -> bool:
    """A live process (a zombie left unreaped by the container's init is dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.mark.parametrize("child", ["default", "ignore"])
def test_a_command_past_its_limit_is_ended_with_its_children(tmp_path: Path, child: str) -> None:
    script, pids = tmp_path / "hang.py", tmp_path / "pids"
    script.write_text(SCRIPT)
    t = time.monotonic()
    argv = [sys.executable, str(script), str(pids), child]
    with pytest.raises(TimeLimitReached) as e:
        run_with_limit(argv, seconds=1.5, wait=1.0)
    assert time.monotonic() - t < 1.5 + 1.0 + 2.0  # the limit, the SIGTERM wait, slack
    parent, grandchild = (int(x) for x in pids.read_text().split())
    assert not group_alive(parent) and not _alive(parent) and not _alive(grandchild)
    assert "process group" in e.value.how
    # A child that ignores SIGTERM outlives it: SIGKILL after the wait ends it.
    assert ("SIGKILL" in e.value.how) == (child == "ignore")


def test_a_command_within_its_limit_gives_its_status(tmp_path: Path) -> None:
    assert run_with_limit([sys.executable, "-c", "raise SystemExit(3)"], seconds=30) == 3
    assert not group_alive(os.getpid() + 10**7)  # no such group
