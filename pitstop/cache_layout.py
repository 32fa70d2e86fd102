"""Where pitstop's cache lives and what it holds (one place for the root and the names).

The root is `--cache-dir`, else $PITSTOP_CACHE_DIR, else ~/.cache/pitstop. Under it:
`stores/<key>/` (token stores, pitstop.data.cache), `fingerprints/` (memoised file
digests), `cpu_peak.json` / `cpu_peak_bf16.json` (the measured CPU peaks for MFU),
`cpu_precision.json` (fp32 against bf16 autocast at a model's shapes) and `compile_check.json`.
"""

from __future__ import annotations

import os
from pathlib import Path

STORES = "stores"
FINGERPRINTS = "fingerprints"
CPU_PEAK = "cpu_peak.json"
CPU_PEAK_BF16 = "cpu_peak_bf16.json"
CPU_PRECISION = "cpu_precision.json"
COMPILE_CHECK = "compile_check.json"


def cache_root(cache_dir: str | os.PathLike[str] | None) -> Path:
    """The cache directory: `cache_dir` if given, else $PITSTOP_CACHE_DIR, else ~/.cache/pitstop."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    env = os.environ.get("PITSTOP_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "pitstop"
