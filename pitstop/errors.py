"""Errors a user can act on. The CLI prints them without a traceback.

`ConfigError` (exit code 2) is a problem with what was asked for: flags, YAML,
impossible combinations. `DataError` (exit code 1) is a problem with an input file.
Both carry every problem found, each saying what is wrong and how to fix it.
"""

from __future__ import annotations


class PitstopError(Exception):
    """Base class: a message meant for the user, printed as is."""

    exit_code = 1

    def __init__(self, problems: str | list[str], *, header: str | None = None) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.header = header
        super().__init__(self.render())

    def render(self) -> str:
        if len(self.problems) == 1 and not self.header:
            return self.problems[0]
        head = self.header or f"{len(self.problems)} problems:"
        return head + "\n" + "\n".join(f"  - {p}" for p in self.problems)


class ConfigError(PitstopError):
    """The configuration (flags or YAML) is invalid. Nothing has been written."""

    exit_code = 2


class DataError(PitstopError):
    """An input file cannot be read as asked."""

    exit_code = 1


class MissingDependencyError(PitstopError):
    """An optional package is needed for what was asked; the message names the install."""

    exit_code = 2
