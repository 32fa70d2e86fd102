"""`compile: auto` by measured payoff: what torch.compile costs and gains, measured once per
configuration on a run that compiles, cached, and reused by the next run's decision.

A compiled step is faster (the norms, rotary embeddings, activations and residual adds
fused), but the first compiled step pays the compile, and whether that pays back depends on
the model, the machine and the run's length. So a run that compiles without a measurement
of its configuration times it on its own steps, which are training steps all the same
(`CompileTiming`, the schedule in `is_eager`):

- the first step runs eagerly, untimed (the allocator's and the kernels' first calls); the
  second compiles; its seconds above a compiled step's are the compile time;
- then eager steps are timed *between* compiled ones, and each eager step's seconds over
  the mean of its two compiled neighbours is one paired ratio: three pairs right after the
  compile, then one every `LATER_EVERY` steps, `LATER_PAIRS` times. Pairs, because a few
  steps timed early against a few timed later measure the host's warm-up and drift as
  much as compile's gain: on the headline model (CPU, 2026-11-28) two eager steps timed
  before the compile and three compiled ones after it said 1.10x where 411-step runs
  measured 1.01-1.04x, so `auto` would have compiled a run that lost 23 s to it;
- each timed eager step follows an untimed eager one: the first eager step after compiled
  ones pays to get eager's memory back (its tensors page-fault in again), which no step of
  an eager run pays; the next eager step runs at an eager run's pace. Timed alone, those
  steps made the record of `python -m bench.compile_payoff --pairs 1 --minutes 2` at
  b4884a3 (2-core AMD EPYC, bf16, 2026-11-28) say 1.18x, where the compiled run's steps
  were 1.07x faster than the eager run's (medians) and the 244-step run lost 11 s;
- the gain is the median paired ratio, an eager step the median eager step (a compiled one
  that over the gain); the ratios are kept, so the next run can tell a gain from the
  host's noise (`probe.CompileSpeed.gain_floor`: the gain they show with 90% confidence);
  the measurement (`probe.CompileSpeed`) goes to the cache
  (`compile_speed-<digest>.json`, one file per key: `speed_key`) and to the run's summary
  (`choices.compile.measured`), and is written again with each later pair, so a longer run
  leaves a steadier record. An eager step costs a compiled run its gain once (the
  untimed one its memory too); the later pairs cost at most 2 x `LATER_PAIRS` such steps,
  in its first ~1,000 steps.

The next run of the configuration decides with them (`probe.choose_compile`): compile when
the floor is above 1x and its planned steps save more than the compile time at the median
gain. inductor's own caches live under pitstop's cache directory (`inductor/`, unless
TORCHINDUCTOR_CACHE_DIR is set), so a second compile of a configuration mostly reads them
back; the record keeps the latest compile's time, which is then that cheaper one.

On a GPU each timed step ends with a device sync (only those steps and the one before each
timed run of them), so the host's clock covers the device's work.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import os
import statistics
import tempfile
from collections import deque
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
    "FIRST_STEPS",
    "LATER_EVERY",
    "LATER_PAIRS",
    "CompileKey",
    "CompileTiming",
    "cached_speed",
    "eager_steps",
    "inductor_cache",
    "is_eager",
    "save_speed",
    "speed_key",
]

FIRST_STEPS = 12  # eager (untimed), the compile, then (compiled, eager x2) x3, compiled
LATER_EVERY = 50  # then two eager steps (the second timed) in this many ...
LATER_PAIRS = 20  # ... this many times
LAST_EAGER = FIRST_STEPS + LATER_EVERY * LATER_PAIRS  # the step after it is the last timed
# In the key: records measured otherwise differ (ratios kept; the eager step timed second).
METHOD = "paired eager and compiled steps, the second eager step of two timed"


def _warms_up(index: int) -> bool:
    """Whether step `index` is the untimed eager step before a timed one: 3, 6 and 9, then
    one in LATER_EVERY, LATER_PAIRS times."""
    if index < FIRST_STEPS:
        return index in (3, 6, 9)
    later, rest = divmod(index - (FIRST_STEPS - 1), LATER_EVERY)
    return rest == 0 and 1 <= later <= LATER_PAIRS


def is_eager(index: int) -> bool:
    """Whether a measuring run's step `index` (0-based, from the run's first step) runs
    eagerly: 0 (untimed), then pairs of eager steps between compiled ones (1 compiles): 3-4,
    6-7 and 9-10, then one pair in LATER_EVERY steps, LATER_PAIRS times. The second step of
    each pair is the timed one."""
    return index == 0 or _warms_up(index) or _warms_up(index - 1)


def eager_steps(total_steps: int) -> int:
    """How many of a measuring run's `total_steps` steps run eagerly."""
    return sum(is_eager(i) for i in range(min(total_steps, LAST_EAGER + 1)))


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
    method: str


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
        "method": METHOD,
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
            tuple(float(r) for r in rec["ratios"]),
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
    """Times a compiling run's steps (the module docstring): `eager_now()` says whether the
    next step runs eagerly, `clock_now()` whether it must end with a device sync;
    `step_done(seconds)` takes each finished step's seconds and returns the measurement each
    time it changes (stored in the cache when `save`); `done()` once nothing is left to
    time."""

    def __init__(
        self,
        key: CompileKey,
        cache_dir: str | Path | None,
        *,
        sync: Callable[[], None] = lambda: None,
        save: bool = True,
    ) -> None:
        self.key, self.cache_dir, self.sync, self.save = key, cache_dir, sync, save
        self.index = 0  # the next step's
        self.last: deque[float] = deque(maxlen=4)  # the last four steps' seconds
        self.compile_step = 0.0  # step 1's seconds: the compile and a compiled step
        self.first_compiled: list[float] = []  # steps 2, 5, 8 and 11
        self.compile_s = 0.0
        self.eager: list[float] = []  # the eager steps' seconds
        self.ratios: list[float] = []  # each eager step over its compiled neighbours' mean

    def eager_now(self) -> bool:
        return is_eager(self.index)

    def clock_now(self) -> bool:
        """The step about to end is timed, or the one before a timed one (its device work
        must not spill into the next step's clock)."""
        return self.index < FIRST_STEPS or any(is_eager(self.index + d) for d in (-1, 0, 1, 2))

    def done(self) -> bool:
        return self.index > LAST_EAGER + 1

    def step_done(self, seconds: float) -> CompileSpeed | None:
        i = self.index
        self.index += 1
        self.last.append(seconds)
        if i == 1:
            self.compile_step = seconds
        elif 1 < i < FIRST_STEPS and not is_eager(i):
            self.first_compiled.append(seconds)
        if i < 4 or not _warms_up(i - 2):
            return None
        before, _, eager, after = self.last  # the untimed eager step is the second
        self.eager.append(eager)
        self.ratios.append(eager / ((before + after) / 2))
        if i < FIRST_STEPS - 1:
            return None
        if i == FIRST_STEPS - 1:  # the compile: its step above the compiled steps after it
            self.compile_s = max(0.0, self.compile_step - statistics.median(self.first_compiled))
        return self._measured()

    def _measured(self) -> CompileSpeed:
        eager = statistics.median(self.eager)
        gain = statistics.median(self.ratios)
        n = len(self.ratios)
        speed = CompileSpeed(
            self.compile_s,
            eager,
            eager / gain,
            f"measured on this run's steps ({n} eager steps, each the second of two between "
            "compiled ones)",
            tuple(self.ratios),
        )
        if self.save:
            save_speed(self.cache_dir, self.key, speed)
        return speed
