"""The start-up banner: every choice the run made and why, printed once to stderr."""

from __future__ import annotations

from typing import Any, TextIO

from pitstop import log
from pitstop.probe import Choice


def format_banner(title: str, facts: dict[str, Any], choices: dict[str, Choice]) -> str:
    width = max([len(k) for k in (*facts, *choices)] + [8])
    lines = [f"pitstop train: {title}"]
    for k, v in facts.items():
        lines.append(f"  {k:<{width}}  {v}")
    lines.append("  choices:")
    for k, c in choices.items():
        lines.append(f"  {k:<{width}}  {_fmt(c.value)}  ({c.reason})")
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if v is True:
        return "on"
    if v is False:
        return "off"
    return str(v)


def print_banner(text: str, stream: TextIO | None = None) -> None:
    """To `stream`, else to pitstop's log (INFO: `--quiet` hides it)."""
    if stream is not None:
        print(text, file=stream, flush=True)
    else:
        log.info(text)
