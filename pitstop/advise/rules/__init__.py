"""Audit rules over a training setup, the data's lengths, the device and a measured profile.

Each rule is a function of a `Context` returning a `Finding` or None, registered
with the sources it applies to ("pitstop", "hf"). A rule whose inputs are missing
(no profile, no data, no GPU) stays quiet rather than guessing. Every effect
states its basis: measured in the given profile, computed from the data's
lengths, FLOPs arithmetic (6·N + 12·L·d·T per token, pitstop/measure/cost_model.py),
or documented (with a reference). Where a rule cannot apply to a source, the
reason is in its docstring (`RULES` lists them).
"""

from __future__ import annotations

# Each section registers its rules with `@rule` when imported; RULES lists them in this order
# (the doctor ranks findings by severity and gain, so the order only shows in RULES itself).
# isort: off
from pitstop.advise.rules.context import RULES, Context, Rule, rule, run_rules
from pitstop.advise.rules import (
    data_loading,
    padding,
    memory,
    precision,
    periodic,
    verdicts,
    correctness,
)
# isort: on

SECTIONS = (data_loading, padding, memory, precision, periodic, verdicts, correctness)

__all__ = ["RULES", "SECTIONS", "Context", "Rule", "rule", "run_rules"]
