"""`compile: auto` by measured payoff: what torch.compile costs and gains, measured once per
configuration on a run that compiles, cached, and reused by the next run's decision.

A compiled step is faster (the norms, rotary embeddings, activations and residual adds
fused), but the first compiled step pays the compile, and whether that pays back depends on
the model, the machine and the run's length. So a run that compiles without a measurement
of its configuration times it on its own first steps, which are training steps all the
same (`CompileTiming`):

- the first `EAGER_STEPS` steps run eagerly (the first untimed: the allocator's and the
  kernels' first calls), then the compiled forward takes over (the same math:
  tests/test_compile_sdpa_docs.py);
- the first compiled step less a compiled step is the compile time; the median of the next
  `COMPILED_STEPS` is a compiled step, the median of the timed eager ones an eager step;
- the three numbers (`probe.CompileSpeed`) go to the cache (`compile_speed-<digest>.json`,
  one file per key: `speed_key`) and to the run's summary (`choices.compile.measured`).

The next run of the configuration decides with them (`probe.choose_compile`): compile when
its planned steps save more than the compile time (by a margin). inductor's own caches live
under pitstop's cache directory (`inductor/`, unless TORCHINDUCTOR_CACHE_DIR is set), so a
second compile of a configuration mostly reads them back; the record keeps the latest
compile's time, which is then that cheaper one.

On a GPU each timed step ends with a device sync (only those few steps), so the host's clock
covers the device's work.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import os
import statistics
import tempfile
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import TypedDict

from pitstop.batching.settings import BatchSettings
from pitstop.core.atomic import write_cache_entry
from pitstop.core.cache_layout import COMPILE_SPEED, INDUCTOR, cache_root, keyed_cache_path
from pitstop.core.config import RunConfig
from pitstop.probe import CompileSpeed

__all__ = [
    "COMPILED_STEPS",
    "EAGER_STEPS",
    "CompileKey",
    "CompileTiming",
    "cached_speed",
    "inductor_cache",
    "save_speed",
    "speed_key",
]

EAGER_STEPS = 3  # the first untimed
COMPILED_STEPS = 3  # timed after the first compiled step (the compile)


class CompileKey(TypedDict):
    """What a compile measurement depends on (`speed_key`); stored in its cache entry and
    checked on reading."""

    device: str
    world_size: int
    torch: str
    transformers: str
    model_config_sha256: str | None
    layout: str
    max_seq_len: int
    micro_batch_size: int | None
    tokens_per_micro_batch: int | None
    attention: str
    precision: str
    gradient_checkpointing: bool
    lora_r: int | None
    load_in_4bit: bool
    strategy: str
    threads: int | None


def speed_key(
    cfg: RunConfig,
    *,
    device: str,
    world_size: int,
    settings: BatchSettings | None,
    attention: str,
    precision: str,
    threads: int | None = None,
) -> CompileKey:
    """What a compile measurement depends on: the device and its count, the versions, the
    model's config, the micro-batch's shape (layout, length, rows or tokens; the config's
    when `settings` is None), the kernels and precision, the settings that change the graph
    (recompute, LoRA, 4-bit, strategy) and, on a CPU, the threads. Not the data, the lr or
    the run's length."""
    import torch
    import transformers

    s = settings
    return {
        "device": device,
        "world_size": world_size,
        "torch": str(torch.__version__),
        "transformers": str(transformers.__version__),
        "model_config_sha256": _sha256(Path(cfg.model or "") / "config.json"),
        "layout": str(s.strategy) if s else cfg.batching,
        "max_seq_len": s.max_seq_len if s else cfg.max_seq_len,
        "micro_batch_size": s.micro_batch_size if s else cfg.micro_batch_size,
        "tokens_per_micro_batch": s.tokens_per_micro_batch if s else cfg.tokens_per_micro_batch,
        "attention": attention,
        "precision": precision,
        "gradient_checkpointing": cfg.gradient_checkpointing,
        "lora_r": cfg.lora_r,
        "load_in_4bit": cfg.load_in_4bit,
        "strategy": cfg.strategy,
        "threads": threads,
    }


def _sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def cached_speed(cache_dir: str | Path | None, key: CompileKey) -> CompileSpeed | None:
    """The configuration's measurement from the cache (None: absent, another key, damaged)."""
    path = keyed_cache_path(cache_root(cache_dir), COMPILE_SPEED, key)
    if path is None or not path.is_file():
        return None
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
        if rec.get("key") != key:
            return None
        return CompileSpeed(
            float(rec["compile_seconds"]),
            float(rec["eager_step_seconds"]),
            float(rec["compiled_step_seconds"]),
            f"reused (cached in {path}, measured {rec.get('measured_at', '?')})",
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # damaged: the next compiling run measures again and replaces it


def save_speed(cache_dir: str | Path | None, key: CompileKey, speed: CompileSpeed) -> None:
    """Store the measurement (best effort: an unwritable cache only means measuring again)."""
    path = keyed_cache_path(cache_root(cache_dir), COMPILE_SPEED, key)
    if path is None:
        return
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    rec = {"key": key, **speed.to_dict(), "measured_at": now}
    write_cache_entry(path, json.dumps(rec, indent=1))


def inductor_cache(cache_dir: str | Path | None) -> str:
    """Where inductor keeps its caches for this run: the user's TORCHINDUCTOR_CACHE_DIR if
    set, else `<pitstop cache>/inductor` (set for this process, before the first compile).

    Importing torch._dynamo (transformers does, loading a model) writes torch's default
    (`<tmp>/torchinductor_<user>`) into TORCHINDUCTOR_CACHE_DIR, so that value is torch's
    choice, not the user's: it is replaced like an unset one."""
    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if given and os.path.abspath(given) != _torch_default_inductor_dir():
        return given
    where = str(cache_root(cache_dir) / INDUCTOR)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = where
    return where


def _torch_default_inductor_dir() -> str:
    """torch's own default inductor cache directory (what it writes into the environment)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # older torch: the same rule, written out
        return os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    return os.path.abspath(default_cache_dir())


class CompileTiming:
    """Times a compiling run's first steps (the module docstring): `eager_now()` says whether
    the next step runs eagerly; `step_done(seconds)` takes each finished step's seconds and
    returns the measurement once it is complete (stored in the cache when `save`)."""

    def __init__(
        self,
        key: CompileKey,
        cache_dir: str | Path | None,
        *,
        sync: Callable[[], None] = lambda: None,
        save: bool = True,
    ) -> None:
        self.key, self.cache_dir, self.sync, self.save = key, cache_dir, sync, save
        self.seconds: list[float] = []

    def eager_now(self) -> bool:
        return len(self.seconds) < EAGER_STEPS

    def step_done(self, seconds: float) -> CompileSpeed | None:
        self.seconds.append(seconds)
        if len(self.seconds) < EAGER_STEPS + 1 + COMPILED_STEPS:
            return None
        eager = statistics.median(self.seconds[1:EAGER_STEPS])
        first = self.seconds[EAGER_STEPS]
        compiled = statistics.median(self.seconds[EAGER_STEPS + 1 :])
        speed = CompileSpeed(
            max(0.0, first - compiled), eager, compiled, "measured on this run's first steps"
        )
        if self.save:
            save_speed(self.cache_dir, self.key, speed)
        return speed
