"""Which kind of program a watched loop is: a Hugging Face / TRL Trainer, Lightning, an
accelerate loop or a plain PyTorch loop.

Read once, at the first optimizer step, from the objects on the call stack: the step of a
`transformers.Trainer` runs inside its `_inner_training_loop` (`self` is the Trainer, and
`self.args` its TrainingArguments or TRL SFTConfig), a Lightning step inside its
`Trainer`'s fit loop, an accelerate step inside `AcceleratedOptimizer.step`. Classes are
matched by module and name along their MRO, so nothing is imported to ask (a script that
never imported Lightning pays nothing). The kind decides the vocabulary of every fix
(`pitstop.advise.setup.Setup.fix`): TrainingArguments / SFTConfig fields for a Trainer
script, `L.Trainer(...)` arguments for Lightning, code lines for a loop.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

TRAINER, LIGHTNING, ACCELERATE, LOOP = "trainer", "lightning", "accelerate", "loop"

# (module prefix, class name) -> kind, checked along each `self`'s MRO.
_KINDS = (
    ("transformers.trainer", "Trainer", TRAINER),
    ("lightning.pytorch.trainer", "Trainer", LIGHTNING),
    ("pytorch_lightning.trainer", "Trainer", LIGHTNING),
    ("lightning.pytorch.core", "LightningModule", LIGHTNING),
    ("pytorch_lightning.core", "LightningModule", LIGHTNING),
    ("accelerate.optimizer", "AcceleratedOptimizer", ACCELERATE),
    ("accelerate.accelerator", "Accelerator", ACCELERATE),
)
# A frame's `self` of these kinds outranks the others (a Trainer runs accelerate inside).
_RANK = {TRAINER: 0, LIGHTNING: 1, ACCELERATE: 2}


@dataclass
class Program:
    """What ran the loop, and for a Trainer its arguments as `to_dict()` gives them."""

    kind: str = LOOP
    args_class: str | None = None  # "TrainingArguments" | "SFTConfig" | a subclass's name
    args: dict[str, object] = field(default_factory=dict)


def _kind_of(obj: Any) -> str | None:
    for cls in type(obj).__mro__:
        mod = getattr(cls, "__module__", "") or ""
        for prefix, name, kind in _KINDS:
            if cls.__name__ == name and mod.startswith(prefix):
                return kind
    return None


def detect_program(max_frames: int = 200) -> Program:
    """The program kind of the loop whose optimizer step is on the stack right now."""
    best: tuple[int, Any, str] | None = None
    frame = sys._getframe(1)
    for _ in range(max_frames):
        if frame is None:
            break
        obj = frame.f_locals.get("self")
        kind = _kind_of(obj) if obj is not None else None
        if kind is not None and (best is None or _RANK[kind] < best[0]):
            best = (_RANK[kind], obj, kind)
        frame = frame.f_back
    if best is None:
        return Program()
    _, obj, kind = best
    if kind != TRAINER:
        return Program(kind)
    args = getattr(obj, "args", None)
    return Program(kind, _args_class(args), _args_dict(args))


def _args_class(args: Any) -> str | None:
    """SFTConfig (TRL) or TrainingArguments: the first of the two along the MRO."""
    if args is None:
        return None
    for cls in type(args).__mro__:
        if cls.__name__ in ("SFTConfig", "TrainingArguments"):
            return cls.__name__
    return type(args).__name__


def _args_dict(args: Any) -> dict[str, object]:
    try:
        d = args.to_dict()
    except Exception:  # arguments pitstop cannot read: the observed settings stand in
        return {}
    return {k: _plain(v) for k, v in d.items()}


def _plain(v: Any) -> Any:
    v = getattr(v, "value", v)  # enums (IntervalStrategy, OptimizerNames) as their value
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    return str(v)
