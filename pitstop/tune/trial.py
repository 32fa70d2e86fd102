"""A trial: a short real training run of one setting, measured; and the trial cache.

`TrialRunner(cfg, ...)(settings)` runs the trainer (the instrumented subclass from
`pitstop.profiling`) in a scratch directory with the knobs of `settings`
applied and tokens per step pinned, and returns a `TrialResult`:

- the first `warmup` steps (allocator warm-up, lazy init, torch.compile's
  compilation) are left out and reported as `warmup_seconds` (and, with compile
  on, `compile_seconds` = warm-up time above what steady steps would take);
- the figure is the *median* step time, measured until it is stable: the run
  stops once the robust standard error of the median (1.253 x 1.4826 x MAD /
  sqrt(n)) is under `rel_tol` of it, after at least `min_steps` steps, or at
  `max_steps` / `max_trial_seconds`;
- tokens/s = mean trained (loss-carrying) tokens per step / median step time;
- peak memory is CUDA's allocator peak, or on CPU the process's peak resident set
  over the trial (reset per trial through /proc/self/clear_refs).

`settings=None` runs the user's configuration exactly as written (the baseline)
and reads back the settings it resolved to (batching auto, default workers, ...).

Trials are cached in `<cache_dir>/tune/trials/`, keyed by the model files, the
data, every config field that can change speed, the device and the measurement
parameters: a second `pitstop tune` of the same setup reuses them.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from pitstop import probe
from pitstop.core import run_record
from pitstop.core.atomic import read_regular_text, write_cache_entry
from pitstop.core.config import RunConfig
from pitstop.core.run_record import read_steps
from pitstop.core.runlock import pid_alive
from pitstop.core.version import __version__
from pitstop.measure.memory import peak_memory, reset_peak_memory
from pitstop.profiling import StepClock, measured_trainer, measurement_config
from pitstop.train.signals import RunInterrupted
from pitstop.tune.search import (
    COMPILE_FAILED,
    OK,
    TrialResult,
    TuneInterrupted,
    free_memory,
    relative_spread,
)
from pitstop.tune.space import Settings, apply_settings, settings_from_choices

# Fields a trial overrides or that cannot change step speed: left out of the cache key.
_KEY_IGNORED = {
    "output", "overwrite", "resume", "report_to", "max_steps", "epochs", "lr", "min_lr_ratio",
    "warmup_steps", "schedule", "save_total_limit", "batching", "tokens_per_step",
    "micro_batch_size", "tokens_per_micro_batch", "grad_accum", "loader_workers",
    "prefetch_factor", "compile", "attention", "gradient_checkpointing", "cache_dir",
}  # fmt: skip


def median_is_stable(values: list[float], rel_tol: float) -> bool:
    """Whether the median of `values` is known to within `rel_tol` (robust standard error)."""
    n = len(values)
    if n < 3:
        return False
    med = statistics.median(values)
    if med <= 0:
        return True
    mad = statistics.median(abs(v - med) for v in values)
    # 1.4826 x MAD estimates sigma for normal noise; the median's standard error is
    # about 1.253 sigma / sqrt(n) (its asymptotic efficiency against the mean).
    return 1.253 * 1.4826 * mad / math.sqrt(n) / med < rel_tol


class TrialRunner:
    """Measures settings with real training steps of `cfg` (see the module docstring)."""

    def __init__(
        self,
        cfg: RunConfig,
        *,
        tokens_per_step: int,
        warmup: int = 2,
        min_steps: int = 8,
        max_steps: int = 30,
        rel_tol: float = 0.02,
        max_trial_seconds: float = 30.0,
        device: Any = None,
        quiet: bool = True,
    ) -> None:
        self.cfg = cfg
        self.tokens_per_step = tokens_per_step
        self.warmup = warmup
        self.min_steps = min_steps
        self.max_steps = max(max_steps, min_steps)
        self.rel_tol = rel_tol
        self.max_trial_seconds = max_trial_seconds
        self.device = device
        self.quiet = quiet

    def params(self) -> dict[str, Any]:
        """Measurement parameters (part of the cache key: they change what a figure means)."""
        return {
            "warmup": self.warmup,
            "min_steps": self.min_steps,
            "max_steps": self.max_steps,
            "rel_tol": self.rel_tol,
        }

    def _stop_when_stable(self, idx: int, clock: StepClock) -> bool:
        starts = clock.starts
        done = [b - a for a, b in itertools.pairwise(starts)]  # steps 0 .. idx-1, complete
        measured = done[self.warmup :]
        if len(measured) >= self.min_steps and median_is_stable(measured, self.rel_tol):
            return True
        return len(measured) >= 3 and sum(measured) >= self.max_trial_seconds

    def __call__(self, settings: Settings | None) -> TrialResult:
        t_start = time.perf_counter()
        trial_cfg = (
            self.cfg
            if settings is None
            else apply_settings(self.cfg, settings, self.tokens_per_step)
        )
        remove_trial_dirs()
        tmp = Path(tempfile.mkdtemp(prefix=f"{TRIAL_DIR_PREFIX}{os.getpid()}-"))
        trainer = None
        try:
            run_cfg = measurement_config(trial_cfg, tmp / "run", self.warmup + self.max_steps)
            free_memory()
            dev_type = self.device.type if self.device is not None else _device_type(self.cfg)
            reset_peak_memory(dev_type)
            out = io.StringIO()
            quiet = contextlib.redirect_stderr(out) if self.quiet else contextlib.nullcontext()
            with quiet:
                kwargs = {"device": self.device} if self.device is not None else {}
                clock = StepClock(on_step_start=self._stop_when_stable)
                trainer = measured_trainer(run_cfg, clock, **kwargs)
                try:
                    summary = trainer.fit()
                except RunInterrupted as e:
                    # The trial's trainer caught the user's SIGINT/SIGTERM (its handlers
                    # replace tune's while it runs): the tune stops, not just this trial.
                    raise TuneInterrupted(e.exit_code - 128) from None
            peak = peak_memory(trainer.run.device.type)
            setup = clock.starts[0] - t_start if clock.starts else 0.0
            tps_math = int(trainer.run.geometry.tokens_per_step)
            steps_per_epoch = int(trainer.run.steps_per_epoch)

            lines = sorted(read_steps(tmp / "run" / run_record.METRICS), key=lambda r: r.step)
        finally:
            compiled = bool(getattr(trainer, "_compiled", False))
            del trainer
            shutil.rmtree(tmp, ignore_errors=True)
            if compiled:
                _reset_compile()
            free_memory()

        resolved = settings_from_choices(trial_cfg, summary.choices)
        measured = [r for r in lines if r.step > self.warmup]
        warm = [r for r in lines if r.step <= self.warmup]
        secs = [r.seconds or 0.0 for r in measured]
        tokens = [int(r.step_trained_tokens or 0) for r in measured]
        result = TrialResult(
            settings if settings is not None else resolved,
            peak_memory_bytes=peak,
            tokens_per_step=tps_math,
            setup_seconds=setup,
            warmup_seconds=sum(r.seconds or 0.0 for r in warm),
            extra={
                "steps_per_epoch": steps_per_epoch,
                "flops_per_token": summary.flops_per_token,
                "peak_flops": summary.peak_flops,
            },
        )
        if not secs:
            result.status, result.error = "failed", "no step ran after the warm-up"
        else:
            med = statistics.median(secs)
            result.step_seconds = med
            result.steps = len(secs)
            result.spread = relative_spread(secs)
            result.tokens_per_second = statistics.fmean(tokens) / med if med > 0 else None
            result.step_times, result.step_tokens = secs, [float(t) for t in tokens]
        asked_compile = settings.compile if settings is not None else self.cfg.compile == "on"
        if resolved.compile and result.step_seconds is not None:
            result.compile_seconds = max(
                0.0, result.warmup_seconds - len(warm) * result.step_seconds
            )
        if asked_compile and not resolved.compile:
            reason = summary.choice_reason("compile")
            result.status, result.error = COMPILE_FAILED, reason or "torch.compile did not run"
        result.seconds = time.perf_counter() - t_start
        return result


TRIAL_DIR_PREFIX = "pitstop-tune-"


def remove_trial_dirs(pid: int | None = None) -> None:
    """Remove process `pid`'s temporary trial directories (None: those of dead tunes).

    A trial's directory is named `pitstop-tune-PID-*`; a stopped tune removes its own,
    a killed one (SIGKILL) cannot, and its checkpoints stayed in the temporary directory.
    """
    for p in Path(tempfile.gettempdir()).glob(f"{TRIAL_DIR_PREFIX}*-*"):
        owner = p.name[len(TRIAL_DIR_PREFIX) :].split("-")[0]
        if not owner.isdigit():
            continue
        if (int(owner) == pid) if pid is not None else not pid_alive(int(owner)):
            shutil.rmtree(p, ignore_errors=True)


def _device_type(cfg: RunConfig) -> str:

    dev, _ = probe.detect_device(cfg.device)
    return dev.type


def _reset_compile() -> None:
    """Drop torch.compile's caches so one trial's graphs do not hold memory in the next."""
    try:
        import torch

        torch._dynamo.reset()
    except Exception:  # best effort: a stale cache costs memory, not correctness
        pass


# --- the cache ----------------------------------------------------------------------


def _file_id(p: Path) -> list[Any]:
    st = p.stat()
    return [p.name, st.st_size, st.st_mtime_ns]


def _path_identity(path: str) -> Any:
    """Cheap identity of a model dir, a token store or a data file: names, sizes, mtimes."""
    p = Path(path).expanduser()
    if p.is_dir():
        manifest = p / "manifest.json"
        if manifest.is_file():  # a token store: its manifest names its content
            return hashlib.sha256(manifest.read_bytes()).hexdigest()
        return sorted(_file_id(f) for f in p.iterdir() if f.is_file())
    if p.is_file():
        return _file_id(p)
    return str(p)


def cache_context(cfg: RunConfig, device: Any, runner: TrialRunner) -> dict[str, Any]:
    """Everything besides the settings that decides a trial's figure."""
    import torch

    fields = {k: v for k, v in cfg.to_dict().items() if k not in _KEY_IGNORED}
    return {
        "pitstop": __version__,
        "torch": torch.__version__,
        "model": [str(Path(cfg.model or "").resolve()), _path_identity(cfg.model or "")],
        "data": [[str(Path(d).resolve()), _path_identity(d)] for d in cfg.data],
        "config": fields,
        "tokens_per_step": runner.tokens_per_step,
        "device": device.to_dict() if hasattr(device, "to_dict") else str(device),
        "threads": torch.get_num_threads(),
        "measure": runner.params(),
    }


class TrialCache:
    """Trial results on disk, one JSON file per (context, settings)."""

    def __init__(self, root: str | Path, context: dict[str, Any]) -> None:
        self.dir = Path(root) / "tune" / "trials"
        self.context = context

    def key(self, s: Settings) -> str:
        blob = json.dumps({"context": self.context, "settings": s.to_dict()}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:32]

    def get(self, s: Settings) -> TrialResult | None:
        path = self.dir / f"{self.key(s)}.json"
        try:
            # Not `read_text`: a FIFO planted at an entry's name would block the tune forever.
            text = read_regular_text(path, "a cached trial result", f"Remove it (rm {path}).")
            return TrialResult.from_dict(json.loads(text)["result"])
        except (OSError, ValueError, KeyError, TypeError):
            return None  # absent or unreadable: measure again

    def put(self, r: TrialResult) -> None:
        if r.status not in (OK, COMPILE_FAILED, "oom", "over-memory"):
            return
        rec = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "result": r.to_dict()}
        path = self.dir / f"{self.key(r.settings)}.json"
        write_cache_entry(path, json.dumps(rec, default=str))  # read-only: re-measure next time
