"""pitstop: fast, cheap and explainable LLM training runs.

`pitstop.train.run(cfg)` trains, `pitstop.prepare_data(cfg)` prepares, and
`pitstop.PitstopCallback` instruments a Hugging Face Trainer; `pitstop.watch()`
times any PyTorch loop. The public API is what
`__all__` lists (locked by tests/test_public_api.py); every other module may move.
"""

from __future__ import annotations

import importlib
from typing import Any

from pitstop.core.config import RunConfig, build_config, load_yaml
from pitstop.core.version import __version__
from pitstop.errors import ConfigError, DataError, PitstopError

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
    "watch",
]

# The package's one deferred import (PEP 562): these names load torch or transformers
# (about 25 s cold on the 2-core dev box, against 0.1 s for the rest), which
# `import pitstop`, `pitstop --help` and a configuration error must not pay for.
_DEFERRED = {
    "train": ("pitstop.train", None),
    "prepare_data": ("pitstop.data.prepare", "prepare_data"),
    "doctor": ("pitstop.advise.doctor", "doctor"),
    "PitstopCallback": ("pitstop.hf", "PitstopCallback"),
    "watch": ("pitstop.anyloop", "watch"),
}


def __getattr__(name: str) -> Any:
    if name not in _DEFERRED:
        raise AttributeError(f"module 'pitstop' has no attribute {name!r}")
    module, attr = _DEFERRED[name]
    loaded = importlib.import_module(module)
    return loaded if attr is None else getattr(loaded, attr)
