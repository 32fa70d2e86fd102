"""File-system faults as errors a user can act on: the path, the errno, and what is safe.

A full disk, a file-size limit, a read-only or vanished directory, a permission
problem, or a file where a directory must be (a `--cache-dir` naming a file) can strike anywhere in `prepare`, `train` or `report`; without this each
surfaced as a traceback (or several chained ones) naming a Python function.
`file_errors()` wraps a command: an `OSError` of that kind becomes a `FileSystemError`
that names the path (or, where the OS gives none, as for a `write()` on a full disk,
where the command was writing), the errno, and what the command leaves safe: what was
written and what to resume from.

A second failure while shutting down (writing a summary into a directory that has
just vanished) must not hide the first: the exception chain is searched for the
first failure, which is reported, and the later one is mentioned after it.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from pitstop.core.errors import PitstopError

HANDLED = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exhausted",
    errno.EROFS: "the file system is read-only",
    errno.ENOENT: "no such file or directory (it was removed or never existed)",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    # A file-size limit (`ulimit -f`; Python ignores the SIGXFSZ that would kill the
    # process) or the file system's largest file: the disk is not full, the file is.
    errno.EFBIG: "the file is larger than this process may write",
    # A file where a directory must be made (`--cache-dir FILE`, $PITSTOP_CACHE_DIR set to
    # a file), or a file standing in a path's middle (`--cache-dir FILE/sub`).
    errno.EEXIST: "a file stands where a directory is needed",
    errno.ENOTDIR: "a part of the path is a file, not a directory",
}
FIXES = {
    errno.ENOSPC: "free space on that disk (or point the command elsewhere)",
    errno.EDQUOT: "free space within your quota (or point the command elsewhere)",
    errno.EROFS: "give a writable location",
    errno.ENOENT: "check that the path exists and nothing removes it while pitstop runs",
    errno.EACCES: "fix the permissions or give a location you can write",
    errno.EPERM: "fix the permissions or give a location you can write",
    errno.EFBIG: (
        "raise the file-size limit (`ulimit -f`; `ulimit -f unlimited` lifts it) or write "
        "to a file system that holds larger files"
    ),
    errno.EEXIST: "give a directory there (move the file away, or point the flag elsewhere)",
    errno.ENOTDIR: "give a path whose every part is a directory (or move the file away)",
}


class FileSystemError(PitstopError):
    """A file-system fault (full disk, read-only, missing path, permissions)."""

    exit_code = 1


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc` and the exceptions it was raised from or while handling, newest first."""
    out: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in out:
        out.append(e)
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    return out


def _handled(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in HANDLED


def first_failure(exc: BaseException) -> BaseException | None:
    """The first user-facing failure in `exc`'s chain: a PitstopError or a handled OSError.

    A PitstopError raised from that OSError explains it better and is preferred.
    None when the chain holds neither (a bug, which keeps its traceback).
    """
    relevant = [e for e in _chain(exc) if isinstance(e, PitstopError) or _handled(e)]
    if not relevant:
        return None
    first = relevant[-1]
    for e in relevant:
        if isinstance(e, PitstopError) and e.__cause__ is first:
            return e
    return first


def _one_line(e: BaseException) -> str:
    text = e.render() if isinstance(e, PitstopError) else str(e)
    text = " ".join(text.split())
    return text if len(text) <= 300 else text[:300] + "..."


def describe(e: OSError, where: str | Path | None) -> str:
    """'PATH: what happened (ERRNO), fix' for a handled OSError."""
    path = e.filename or where
    name = errno.errorcode.get(e.errno or 0, str(e.errno))
    what = f"{path}: " if e.filename else (f"while writing under {path}: " if path else "")
    detail = e.strerror or str(e)
    return f"{what}{HANDLED[e.errno or 0]} ({name}: {detail}); {FIXES[e.errno or 0]}"


@contextmanager
def file_errors(where: str | Path | None, safe: Callable[[], str] | None = None) -> Iterator[None]:
    """Turn a file-system fault (or a PitstopError masked by one) into one clear error.

    `where`: the directory the command writes under (named when the OS gives no path).
    `safe`: says what the command leaves intact; called after the fault, so it reads
    what is on disk then.
    """
    try:
        yield
    except (OSError, PitstopError) as exc:
        first = first_failure(exc)
        no_fault = not any(_handled(e) for e in _chain(exc))
        if first is None or (isinstance(exc, PitstopError) and (first is exc or no_fault)):
            raise  # a PitstopError that nothing file-system related went before keeps its say
        if isinstance(first, PitstopError):
            message = first.render()
        else:
            assert isinstance(first, OSError)
            note = _safe_text(safe)
            message = describe(first, where) + (f". {note}" if note else "")
        if first is not exc and not (isinstance(first, OSError) and exc.__cause__ is first):
            message += f" (then, while stopping: {_one_line(exc)})"
        err = FileSystemError(message)
        err.exit_code = first.exit_code if isinstance(first, PitstopError) else err.exit_code
        raise err from exc


def _safe_text(safe: Callable[[], str] | None) -> str:
    if safe is None:
        return ""
    try:
        return safe()
    except OSError:  # the disk that just failed may fail again; the message still goes out
        return ""


@contextmanager
def command_file_errors(command: str, output: str | None, cache_dir: str | None) -> Iterator[None]:
    """`file_errors` for a CLI command, from its --output and --cache-dir flags."""
    from pitstop.core.cache_layout import cache_root

    cache = str(cache_root(cache_dir))
    where = cache if command == "prepare" else (output or None)
    with file_errors(where, lambda: safe_note(command, output, cache)):
        yield


def safe_note(command: str, output: str | None, cache: str | None) -> str:
    """What a failed `command` leaves intact, said from what is on disk now."""
    if command == "prepare":
        return (
            f"Nothing was added to the cache {cache}: a token store is published only once "
            "it is complete; the input files are untouched"
        )
    if command == "report":
        return (
            "An existing report was not touched: a report replaces the old one only when complete"
        )
    if command in ("train", "tune", "profile") and output:
        from pitstop.train.checkpoint import complete_checkpoints

        ckpts = complete_checkpoints(Path(output) / "checkpoints")
        if ckpts:
            return f"The newest complete checkpoint is {ckpts[-1][1]}: rerun with --resume to continue from it"
        if not os.path.isdir(output):
            return f"No run directory {output} exists: nothing of this run survives; start again"
        return f"No complete checkpoint exists in {output}: a rerun starts from the beginning"
    return ""
