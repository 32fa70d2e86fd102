"""A doctor finding, how findings are ranked, and the terminal table they print as."""

from __future__ import annotations

import shutil
import textwrap
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TypedDict

SEVERITIES = ("high", "medium", "low")
# Where an effect's number comes from; a finding never quotes a multiplier without one.
BASES = ("measured in this profile", "computed from the data", "FLOPs arithmetic", "documented")


class FindingRecord(TypedDict):
    """A Finding as JSON holds it (`Finding.to_dict`; findings.json, `doctor --json`)."""

    id: str
    severity: str
    title: str
    evidence: dict[str, Any]  # the numbers the rule saw, by name (each rule its own)
    effect: str
    basis: str
    fix: str
    gain: float
    reference: str | None
    notes: list[str]
    gain_measured: bool


@dataclass
class Finding:
    """One thing to change (or to stop believing), with the numbers behind it."""

    id: str
    severity: str  # high | medium | low
    title: str
    evidence: dict[str, Any]  # the numbers the rule saw
    effect: str  # expected gain or cost, with its arithmetic
    basis: str  # one of BASES
    fix: str  # the exact pitstop option or Hugging Face field and value
    gain: float = 0.0  # estimated fraction of step time saved; used for ranking only
    reference: str | None = None  # where a documented basis is documented
    notes: list[str] = field(default_factory=list)
    # The gain is a share of step time measured in the profile, the number the effect quotes
    # (not an estimate, nor 0.0 for a finding that reports without promising a speed-up).
    # A measured gain that prints as 0.0% is measurement noise: `reported` drops it.
    gain_measured: bool = False

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity {self.severity!r} not in {SEVERITIES}")  # a bug
        if self.basis not in BASES:
            raise ValueError(f"basis {self.basis!r} not in {BASES}")  # a bug

    def to_dict(self) -> FindingRecord:
        d = FindingRecord(**asdict(self))
        d["gain"] = round(self.gain, 4)
        return d


def is_noise(f: Finding | FindingRecord) -> bool:
    """A finding whose measured effect prints as 0.0% of step time: nothing to gain."""
    d = f.to_dict() if isinstance(f, Finding) else f
    return bool(d.get("gain_measured")) and round(100 * float(d.get("gain") or 0.0), 1) == 0.0


def reported(findings: list[Finding]) -> list[Finding]:
    """The findings worth printing: those whose measured effect is 0.0% are left out (a fix
    that acts on none of the measured step time is advice the profile contradicts)."""
    return [f for f in findings if not is_noise(f)]


def rank(findings: list[Finding]) -> list[Finding]:
    """Severity first, then the estimated gain (largest first), then id for a stable order."""
    order = {s: i for i, s in enumerate(SEVERITIES)}
    return sorted(findings, key=lambda f: (order[f.severity], -f.gain, f.id))


def format_findings(findings: Sequence[Finding | FindingRecord], width: int | None = None) -> str:
    """A terminal table: one block per finding, severity and title first, then why and how."""
    # A findings.json written before `reported` filtered may still hold a 0.0% finding.
    rows = [f.to_dict() if isinstance(f, Finding) else f for f in findings if not is_noise(f)]
    if not rows:
        return "no findings: nothing in the configuration, data or profile needs changing"
    width = width or min(110, shutil.get_terminal_size((100, 20)).columns)
    head = f"{'#':>2}  {'severity':<8}  finding"
    out = [head, "-" * min(width, 100)]
    indent = " " * 14
    for i, f in enumerate(rows, 1):
        out.append(f"{i:>2}  {f['severity']:<8}  {f['title']}  [{f['id']}]")
        ev = ", ".join(f"{k}={_fmt(v)}" for k, v in f["evidence"].items() if v is not None)
        for label, text in (
            ("evidence", ev),
            ("effect", f"{f['effect']} ({f['basis']})"),
            ("fix", f["fix"]),
        ):
            wrapped = textwrap.wrap(
                text, width=max(40, width - len(indent) - 10), break_on_hyphens=False
            )
            for j, line in enumerate(wrapped or [""]):
                out.append(f"{indent}{label + ':' if j == 0 else '':<10}{line}")
    return "\n".join(out)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_fmt(x)}" for k, x in v.items() if x is not None) + "}"
    return str(v)
