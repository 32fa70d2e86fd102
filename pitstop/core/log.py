"""pitstop's messages on stderr, through the standard `logging` module (logger "pitstop").

Notices (the banner, progress lines, "model loaded in 1.2 s", the result line) are INFO;
"warning: ..." and "... skipped" lines are WARNING. Errors a command ends with are not
logged here: `pitstop.cli` always prints them. `--log-level` and `--quiet` (= warning) on
every command set the level (`set_level`); `PITSTOP_LOG_LEVEL` does the same for library
use. The progress bars (tqdm) follow it: hidden below INFO (`progress_enabled`).

The handler writes to whatever `sys.stderr` is at the time of each message (not the stream
of the moment it was made), so redirected and captured streams see every line; the logger
does not propagate, so a user's root handler does not print each line twice. Messages keep
their own "pitstop: " prefix (the format is the bare message).
"""

from __future__ import annotations

import logging
import os
import sys

LEVELS = ("debug", "info", "warning", "error")

logger = logging.getLogger("pitstop")


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A StreamHandler on the current sys.stderr."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:  # logging assigns it in __init__
        pass


def _install() -> None:
    if any(isinstance(h, _StderrHandler) for h in logger.handlers):
        return
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.propagate = False
    set_level(os.environ.get("PITSTOP_LOG_LEVEL", "info"))


def set_level(level: str) -> None:
    """debug, info, warning or error (ValueError for anything else)."""
    if level.lower() not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, got {level!r}")
    logger.setLevel(level.upper())


def progress_enabled() -> bool:
    """Whether progress bars and lines show (the level lets INFO through)."""
    return logger.isEnabledFor(logging.INFO)


def info(msg: str) -> None:
    logger.info(msg)


def warning(msg: str) -> None:
    logger.warning(msg)


_install()
