"""Output paths checked before any work starts: a file where a directory is needed, or the reverse.

Without this, `pitstop tune --output DIR` trained for minutes and then died in `open()`
with IsADirectoryError, and `pitstop profile --trace FILE` with FileExistsError from
`mkdir`. The checks only read the file system; what cannot be known in advance
(a full disk, permissions) is `fs_errors`' job.
"""

from __future__ import annotations

from pathlib import Path

from pitstop.core.errors import ConfigError


def _blocking_file(path: Path) -> Path | None:
    """The first ancestor of `path` that exists and is not a directory (nothing can go under it)."""
    for parent in reversed(path.parents):
        if parent.exists() and not parent.is_dir():
            return parent
    return None


def file_output_problem(flag: str, value: str | Path | None, example: str) -> str | None:
    """Why `value` cannot be written as a file, or None. `example` is a file name to suggest."""
    if value is None or str(value) == "":
        return None if value is None else f"{flag} is empty; give a file path"
    p = Path(value)
    if p.is_dir():
        return f"{flag} {p} is a directory; give a file path (e.g. {p / example})"
    blocker = _blocking_file(p)
    if blocker is not None:
        return f"{flag} {p}: {blocker} is a file, so nothing can be written under it; give another path"
    return None


def dir_output_problem(flag: str, value: str | Path | None) -> str | None:
    """Why `value` cannot be (or become) a directory to write into, or None."""
    if value is None or str(value) == "":
        return None if value is None else f"{flag} is empty; give a directory"
    p = Path(value)
    if p.exists() and not p.is_dir():
        return f"{flag} {p} is a file; give a directory (a new or an empty one)"
    blocker = _blocking_file(p)
    if blocker is not None:
        return f"{flag} {p}: {blocker} is a file, so no directory can be made under it; give another path"
    return None


def check_outputs(
    *,
    files: dict[str, tuple[str | Path | None, str]] | None = None,
    dirs: dict[str, str | Path | None] | None = None,
) -> list[str]:
    """Every problem with the named outputs: `files` maps a flag to (value, example name)."""
    problems = [file_output_problem(f, v, ex) for f, (v, ex) in (files or {}).items()]
    problems += [dir_output_problem(f, v) for f, v in (dirs or {}).items()]
    return [p for p in problems if p]


def require_outputs(
    *,
    files: dict[str, tuple[str | Path | None, str]] | None = None,
    dirs: dict[str, str | Path | None] | None = None,
) -> None:
    """ConfigError (exit 2, nothing written) naming every output of the wrong kind."""
    problems = check_outputs(files=files, dirs=dirs)
    if problems:
        header = None if len(problems) == 1 else f"invalid outputs ({len(problems)} problems):"
        raise ConfigError(problems, header=header)
