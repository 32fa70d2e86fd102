"""Atomic file writes: a reader sees the old file or the new one, never half of either.

Every file pitstop writes that something else reads (summary.json, checkpoint
metadata, cache entries, the token store's directory) goes through here: write a
temporary sibling, optionally fsync it, then `os.replace` it into place.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any


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
