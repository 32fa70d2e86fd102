"""The start-up banner (every choice the run made and why, printed once to stderr) and
the result line printed at the end."""

from __future__ import annotations

from typing import Any, TextIO

from pitstop.core import log
from pitstop.probe import Choice
from pitstop.train.build import Run


def run_banner(run: Run, *, total_steps: int, resumed_from: str | None) -> str:
    """The banner of a training run: the model, the data, the plan, then every choice."""
    g, cfg = run.geometry, run.cfg
    n_params = sum(p.numel() for p in run.model.parameters())
    peak = run.peak_source
    if run.peak_flops:
        peak = f"{run.peak_flops / 1e12:.3f} TFLOP/s ({run.peak_source})"
    facts = {
        "model": f"{cfg.model} ({n_params / 1e6:.1f}M parameters)",
        "data": f"{run.steps_per_epoch} optimizer steps per epoch",
        "run": f"{total_steps} optimizer steps of {g.tokens_per_step:,} tokens "
        f"(rows of {g.max_seq_len}, {g.micro})",
        "lr": f"{cfg.lr:g}, {run.warmup} warm-up steps, {cfg.schedule} to "
        f"{cfg.min_lr_ratio:g}x; clip {cfg.max_grad_norm:g}",
        "output": str(run.out) + (f" (resuming from {resumed_from})" if resumed_from else ""),
        "peak": peak,
    }
    return format_banner(run.dev.name, facts, run.choices)


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
