"""Where pitstop's cache lives and what it holds (one place for the root and the names).

The root is `--cache-dir`, else $PITSTOP_CACHE_DIR, else ~/.cache/pitstop. Under it:
`stores/<key>/` (token stores, pitstop.data.cache), `fingerprints/` (memoised file
digests), `cpu_peak-<digest>.json` / `cpu_peak_bf16-<digest>.json` (the measured CPU peaks
for MFU), `cpu_precision-<digest>.json` (fp32 against bf16 autocast at a model's shapes),
`attention_rows-<digest>.json` (sdpa_docs' two CPU paths at an attention shape,
pitstop.train.attention_rows),
`compile_check-<digest>.json`, `compile_speed-<digest>.json` (what torch.compile costs and
gains for a configuration, pitstop.train.compile_record) and `inductor/` (torch inductor's
own caches, unless TORCHINDUCTOR_CACHE_DIR is set).

A measurement's file is named by a digest of its key (`keyed_cache_path`): one file per
key, so a measurement under another key (other shapes, another thread count) never
replaces it. With one file per kind, two models or thread counts used in turn overwrote
each other's entry, the next run measured again, and a choice near its threshold (the CPU
precision) could come out the other way: a measured choice must be made once.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

STORES = "stores"
FINGERPRINTS = "fingerprints"
CPU_PEAK = "cpu_peak.json"
CPU_PEAK_BF16 = "cpu_peak_bf16.json"
CPU_PRECISION = "cpu_precision.json"
ATTENTION_ROWS = "attention_rows.json"
COMPILE_CHECK = "compile_check.json"
COMPILE_SPEED = "compile_speed.json"
INDUCTOR = "inductor"


def cache_root(cache_dir: str | os.PathLike[str] | None) -> Path:
    """The cache directory: `cache_dir` if given, else $PITSTOP_CACHE_DIR, else ~/.cache/pitstop."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    env = os.environ.get("PITSTOP_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "pitstop"


def keyed_cache_path(cache_dir: str | os.PathLike[str] | None, name: str, key: Any) -> Path | None:
    """`<cache_dir>/<stem>-<digest of key><suffix>` for a cache file `name`; None without a
    cache directory. The key is still stored in the file and checked on reading."""
    if not cache_dir:
        return None
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    stem, suffix = os.path.splitext(name)
    return Path(cache_dir) / f"{stem}-{digest}{suffix}"
