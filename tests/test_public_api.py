"""The public API is small and explicit; a change to it must be deliberate."""

from __future__ import annotations

import subprocess
import sys

import pitstop

EXPECTED = {
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
}


def test_all_is_locked() -> None:
    assert set(pitstop.__all__) == EXPECTED


def test_every_public_name_resolves() -> None:
    for name in pitstop.__all__:
        assert getattr(pitstop, name) is not None, name
    assert callable(pitstop.train.run) and callable(pitstop.prepare_data)


def test_import_is_light() -> None:
    """`import pitstop` and the config must not pull in torch (the CLI's error paths stay fast)."""
    code = "import sys, pitstop, pitstop.core.config, pitstop.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
