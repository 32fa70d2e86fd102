"""The rules' input (`Context`), their registry (`RULES`, `@rule`) and `run_rules`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pitstop.advise.environment import Environment
from pitstop.advise.facts import DataFacts, ModelFacts
from pitstop.advise.finding import Finding
from pitstop.advise.setup import Setup
from pitstop.measure.verdict import Verdict, phase_shares, verdict
from pitstop.probe import DeviceInfo, PrecisionSpeed, choose_precision

# The rank a LoRA setup is priced at when it does not say its rank (peft's examples' 16).
DEFAULT_LORA_R = 16


@dataclass
class Context:
    setup: Setup
    device: DeviceInfo
    env: Environment = field(default_factory=Environment)
    data: DataFacts | None = None
    model: ModelFacts | None = None
    profile: dict[str, Any] | None = None
    baseline: Setup | None = None
    transformers: str | None = None  # the target's release; None: the installed one (env)
    # What `--precision auto` measured on this CPU (doctor.planned_precision); None: unmeasured
    measured_precision: PrecisionSpeed | None = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def verdict(self) -> Verdict | None:
        return verdict(self.profile) if self.profile else None

    @property
    def shares(self) -> dict[str, float]:
        return phase_shares(self.profile)[0] if self.profile else {}

    @property
    def precision(self) -> str:
        """The precision the run uses; `auto` resolved the way pitstop's probe resolves it."""
        p = self.setup.precision
        return p if p != "auto" else choose_precision(p, self.device, self.measured_precision).value

    def base_step_seconds(self) -> float | None:
        """Mean step seconds without the periodic phases (checkpoint, eval, logging)."""
        if not self.profile:
            return None
        ph = self.profile.get("phases") or {}
        total = float(sum(self.profile.get("step_seconds") or [])) or sum(ph.values())
        k = max(1, int(self.profile.get("steps") or 1))
        periodic = sum(float(ph.get(p, 0.0)) for p in ("checkpoint", "eval", "logging"))
        return max(total - periodic, 0.0) / k or None


Rule = Callable[[Context], Finding | None]
RULES: list[tuple[str, tuple[str, ...], Rule]] = []


def rule(rule_id: str, sources: tuple[str, ...] = ("pitstop", "hf")) -> Callable[[Rule], Rule]:
    def deco(fn: Rule) -> Rule:
        RULES.append((rule_id, sources, fn))
        return fn

    return deco


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def lora_rank(ctx: Context) -> int | None:
    """The LoRA rank the cost model prices (DEFAULT_LORA_R when a LoRA setup omits it)."""
    return (ctx.setup.lora_r or DEFAULT_LORA_R) if ctx.setup.lora else None


def run_rules(ctx: Context) -> list[Finding]:
    out = []
    for _, sources, fn in RULES:
        if ctx.setup.source in sources:
            f = fn(ctx)
            if f is not None:
                out.append(f)
    return out
