"""The user-facing errors under the path most of the code imports them by.

They live in `pitstop/errors.py`, below the catalogue and core (docs/architecture.md: the
catalogue raises them, and core reads the catalogue); the names here are the same objects,
so `except pitstop.core.errors.ConfigError` catches what `pitstop.errors` raises.
"""

from __future__ import annotations

from pitstop.errors import (
    ConfigError,
    DataError,
    MissingDependencyError,
    PitstopError,
    short_repr,
)

__all__ = ["ConfigError", "DataError", "MissingDependencyError", "PitstopError", "short_repr"]
