"""pitstop: fast, cheap and explainable LLM training runs.

`pitstop.train.run(cfg)` trains, `pitstop.prepare_data(cfg)` prepares, and
`pitstop.PitstopCallback` instruments a Hugging Face Trainer. The public API is what `__all__` lists (locked by tests/test_public_api.py); every
other module may move. Heavy imports (torch, transformers) happen on first use, so
`import pitstop` stays fast.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "DataError",
    "PitstopCallback",
    "PitstopError",
    "RunConfig",
    "__version__",
    "build_config",
    "doctor",
    "load_yaml",
    "prepare_data",
    "train",
]

_LAZY = {
    "RunConfig": ("pitstop.config", "RunConfig"),
    "build_config": ("pitstop.config", "build_config"),
    "load_yaml": ("pitstop.config", "load_yaml"),
    "ConfigError": ("pitstop.errors", "ConfigError"),
    "DataError": ("pitstop.errors", "DataError"),
    "PitstopError": ("pitstop.errors", "PitstopError"),
    "prepare_data": ("pitstop.data.prepare", "prepare_data"),
    "doctor": ("pitstop.advise.doctor", "doctor"),
    "PitstopCallback": ("pitstop.hf", "PitstopCallback"),
}


def __getattr__(name: str) -> Any:
    if name == "train":  # the subpackage: `pitstop.train.run(cfg)` trains
        import importlib

        return importlib.import_module("pitstop.train")
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'pitstop' has no attribute {name!r}")
