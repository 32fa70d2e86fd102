"""Atomic file writes: a reader sees the old file or the new one, never half of either.

Every file pitstop writes that something else reads (summary.json, checkpoint
metadata, cache entries, the token store's directory) goes through here: write a
temporary sibling, optionally fsync it, then `os.replace` it into place.

Reads of files in places others can write (the cache, a run's lock) go through
`open_regular`: a FIFO planted where a cache file should be blocked a plain open forever.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any

from pitstop.core.errors import PitstopError


def fsync_dir(path: str | Path) -> None:
    """Make a rename inside `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: str | Path, text: str, *, fsync: bool = True) -> None:
    """Replace `path` with `text`. The random suffix keeps concurrent writers apart."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(
    path: str | Path, obj: Any, *, indent: int | None = 1, fsync: bool = True
) -> None:
    text = json.dumps(obj, indent=indent, default=str) + "\n"
    write_text_atomic(path, text, fsync=fsync)


def write_cache_entry(path: str | Path, text: str) -> bool:
    """Best-effort atomic write of a cache file; False when the cache is not writable.

    A cache that cannot be written only costs recomputing the entry next time.
    """
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, text, fsync=False)
    except OSError:
        return False
    return True


class NotARegularFile(PitstopError):
    """A path pitstop reads or locks is a FIFO, a socket, a device or a directory."""

    exit_code = 1


_KINDS = (
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a directory"),
)


def kind_of(mode: int) -> str:
    """What a non-regular file is, in words ("a named pipe (FIFO)")."""
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def not_regular_message(path: str | Path, mode: int, role: str, fix: str) -> str:
    why = "reading it could wait forever" if stat.S_ISFIFO(mode) else "it cannot be read as one"
    return (
        f"{path} is {kind_of(mode)}, not a regular file, where pitstop keeps {role}; "
        f"{why}, so pitstop stops. {fix}"
    )


def open_regular(path: str | Path, flags: int, role: str, fix: str, mode: int = 0o644) -> int:
    """`os.open` that never blocks on a FIFO and refuses anything but a regular file.

    O_NONBLOCK makes the open of a FIFO return at once (a plain open waits for a writer
    that never comes: the earlier hostile trial hung there); the fstat then refuses it,
    naming the path, what it is, and `fix`. The returned descriptor is blocking again.
    """
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotARegularFile(not_regular_message(path, st.st_mode, role, fix))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular_text(path: str | Path, role: str, fix: str) -> str:
    """The text of `path`, refused (NotARegularFile) unless it is a regular file.

    OSError (a missing file included) passes through, as from `Path.read_text`.
    """
    fd = open_regular(path, os.O_RDONLY, role, fix)
    with open(fd, encoding="utf-8", closefd=True) as f:
        return f.read()
