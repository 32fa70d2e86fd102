"""Batching: the epoch plan (pack / bucket / pad), micro-batches, the loader, and `auto`.

The public API the trainer, tuner and prepare stats use is re-exported here, lazily:
`from pitstop.batching.pack import best_fit_decreasing` (prepare's length statistics)
must not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AutoChoice": "auto",
    "StrategyTiming": "auto",
    "choose_batching": "auto",
    "IGNORE_INDEX": "collate",
    "collate": "collate",
    "LoaderError": "loader",
    "MicroBatchLoader": "loader",
    "default_loader_workers": "loader",
    "sequence_targets": "loader",
    "best_fit_decreasing": "pack",
    "Efficiency": "plan",
    "MicroBatchSpec": "plan",
    "Plan": "plan",
    "build_plan": "plan",
    "measure_efficiency": "plan",
    "plan_efficiency": "plan",
    "step_micro_batches": "plan",
    "STRATEGIES": "settings",
    "BatchSettings": "settings",
    "Strategy": "settings",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pitstop.batching' has no attribute {name!r}")
    return getattr(importlib.import_module(f"pitstop.batching.{_EXPORTS[name]}"), name)


def __dir__() -> list[str]:
    return __all__
