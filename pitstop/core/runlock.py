"""The run directory's writer lock: one training process writes an OUT_DIR at a time.

`OUT_DIR/.lock` is held with `fcntl.flock(LOCK_EX)` for the whole run and records
"pid host" of its holder. The kernel drops the lock when the process dies (SIGKILL
included), so a stale lock never blocks a resume. Readers (`report`, `compare`) never
take it. Several processes of one run: the `--nproc` launcher takes it and tells its
ranks through PITSTOP_RUN_LOCK (its pid); under plain torchrun rank 0 takes it.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from types import TracebackType

from pitstop.core.atomic import NotARegularFile, not_regular_message, open_regular
from pitstop.core.errors import PitstopError

LOCK_NAME = ".lock"
HELD_ENV = "PITSTOP_RUN_LOCK"  # pid of the launcher that holds the lock for this process

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no flock; the run goes unlocked
    fcntl = None  # type: ignore[assignment]


class RunInProgress(PitstopError):
    """Another process is writing this run directory."""

    exit_code = 1


class RunLock:
    """A held lock; `release()` (or leaving the `with` block) lets the next writer in."""

    def __init__(self, fd: int | None, path: Path) -> None:
        self.fd = fd
        self.path = path

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


def _holder_text(fd: int) -> str:
    raw = os.pread(fd, 200, 0).decode("utf-8", "replace").split()
    pid = raw[0] if raw else "?"
    host = raw[1] if len(raw) > 1 else "?"
    return f"pid {pid}, host {host}"


def _lock_fix(path: Path) -> str:
    return f"Remove it (rm -r {path}); pitstop creates its lock file again."


def in_progress_message(out: str | Path, holder: str) -> str:
    return (
        f"--output {out}: run in progress ({holder}); wait for it to end or stop that "
        f"process first (its lock, {Path(out) / LOCK_NAME}, is released when it exits)"
    )


def _ours(fd: int) -> bool:
    """True when the holder is the `--nproc` launcher that started this process."""
    pid = os.environ.get(HELD_ENV)
    return bool(pid) and os.pread(fd, 200, 0).decode("utf-8", "replace").split()[:1] == [pid]


def holder(out: str | Path) -> str | None:
    """ "pid N, host H" of another process writing `out` now, else None. Changes nothing."""
    path = Path(out) / LOCK_NAME
    if fcntl is None or not path.is_file():
        return None
    try:
        fd = open_regular(path, os.O_RDONLY, "the run's lock", _lock_fix(path))
    except (OSError, NotARegularFile):
        return None  # a reader says nothing about a lock it cannot read; a writer refuses
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None if _ours(fd) else _holder_text(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def acquire(out: str | Path) -> RunLock:
    """Take `out`'s lock for this process (creating `out`), or raise RunInProgress.

    A process whose `--nproc` launcher holds the lock gets a no-op lock.
    """
    out = Path(out)
    path = out / LOCK_NAME
    if fcntl is None:
        return RunLock(None, path)
    out.mkdir(parents=True, exist_ok=True)
    if path.is_dir() and not path.is_symlink():  # O_RDWR on a directory fails with EISDIR
        mode = os.stat(path).st_mode
        raise NotARegularFile(not_regular_message(path, mode, "the run's lock", _lock_fix(path)))
    # Not a plain open: a FIFO at the lock's name would take the lock and then fail in
    # ftruncate with EINVAL (a traceback), and a reader of it would block forever.
    fd = open_regular(path, os.O_RDWR | os.O_CREAT, "the run's lock", _lock_fix(path))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        ours, who = _ours(fd), _holder_text(fd)
        os.close(fd)
        if ours:
            return RunLock(None, path)
        raise RunInProgress(in_progress_message(out, who)) from None
    # Written only once held: the holder line always names the live holder.
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    return RunLock(fd, path)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this machine (another user's counts as alive): a
    leftover named after a dead process is safe to remove."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True
