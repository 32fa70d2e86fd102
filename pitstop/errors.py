"""Errors a user can act on. The CLI prints them without a traceback.

`ConfigError` (exit code 2) is a problem with what was asked for: flags, YAML,
impossible combinations. `DataError` (exit code 1) is a problem with an input file.
Both carry every problem found, each saying what is wrong and how to fix it.

The ground floor's ground floor: this module imports nothing of pitstop's, so every
package may raise these, the catalogue (`pitstop.catalog`) and `pitstop.core` included
(docs/architecture.md). `pitstop.core.errors` names the same classes.
"""

from __future__ import annotations

from itertools import islice


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


def short_repr(value: object, limit: int = 80, _depth: int = 0) -> str:
    """repr(value) cut to about `limit` characters, for error messages.

    A value read from a file must never be expanded whole into a message (a YAML
    alias bomb is gigabytes once walked): a container shows its first few items, each
    shortened the same way, two levels deep at most, so the cost is bounded.
    """
    if isinstance(value, (dict, list, tuple, set, frozenset)):
        is_map = isinstance(value, dict)
        open_, close = ("{", "}") if is_map or isinstance(value, (set, frozenset)) else ("[", "]")
        if _depth >= 2:
            return f"{open_}...{len(value)} items{close}" if value else open_ + close
        items = islice(value.items(), 3) if is_map else islice(value, 3)  # type: ignore[union-attr]
        head = [
            f"{short_repr(x[0], 16, _depth + 1)}: {short_repr(x[1], 16, _depth + 1)}"
            if is_map
            else short_repr(x, 16, _depth + 1)
            for x in items
        ]
        more = f", ...{len(value) - 3} more" if len(value) > 3 else ""
        text = open_ + ", ".join(head) + more + close
    elif isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        text = f"an integer of {value.bit_length()} bits"  # repr of a huge int can itself fail
    elif isinstance(value, str) and len(value) > limit:
        text = repr(value[:limit]) + f"... ({len(value):,} characters)"
    else:
        text = repr(value)
    return text if len(text) <= 2 * limit else text[: 2 * limit] + "..."
