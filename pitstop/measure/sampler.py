"""Background device sampling: CPU utilisation and memory, GPU utilisation, memory and power.

A daemon thread samples at a fixed interval while training runs. CPU and RSS come
from psutil; GPU numbers come from NVML (the `nvidia-ml-py` package, imported only
when a GPU is asked for and available; without it only the CPU is sampled, and
`summary()["gpu"]` says why). Sampling costs one NVML/psutil call per interval on
a thread that sleeps in between, so it does not touch the training loop.

`make_sampler(enabled=False)` returns a `NullSampler` with the same interface that
does nothing, so the loop never needs `if sampling:`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, TypedDict

import psutil


class Stat(TypedDict):
    mean: float
    max: float


class SamplerSummary(TypedDict, total=False):
    """`summary()`: the interval, the sample count, the GPU status, and each sampled metric's
    mean and maximum (the GPU ones only where NVML answered; empty when sampling is off)."""

    interval_s: float
    samples: int
    gpu: str
    cpu_percent: Stat
    process_cpu_percent: Stat
    rss_bytes: Stat
    children_rss_bytes: Stat
    gpu_util_percent: Stat
    gpu_memory_bytes: Stat
    gpu_power_watts: Stat


class NullSampler:
    """A sampler that samples nothing (sampling disabled)."""

    samples: list[dict[str, float]] = []  # noqa: RUF012 - always empty, never mutated

    def start(self) -> NullSampler:
        return self

    def stop(self) -> None:
        return None

    def summary(self) -> SamplerSummary:
        return SamplerSummary()

    def __enter__(self) -> NullSampler:
        return self

    def __exit__(self, *_: Any) -> None:
        return None


def _nvml_handle(index: int) -> tuple[Any, Any, str]:
    """(pynvml module, device handle, reason) or (None, None, why not)."""
    try:
        import pynvml  # from the nvidia-ml-py package
    except ImportError:
        return None, None, "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(index), "NVML"
    except Exception as e:  # NVMLError subclasses: no driver, no device
        return None, None, f"NVML unavailable: {e}"


class Sampler:
    """Samples this process (and its children, e.g. loader workers) and optionally one GPU.

    Each sample: `t` (seconds since start), `cpu_percent` (whole machine, 100 = all
    cores busy), `process_cpu_percent` (this process, 100 = one core),
    `rss_bytes` (this process), `children_rss_bytes` (its children; pages they
    share with the parent are counted again), and with a GPU `gpu_util_percent`,
    `gpu_memory_bytes`, `gpu_power_watts`.
    """

    def __init__(self, interval_s: float = 0.5, gpu_index: int | None = None) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self.interval_s = interval_s
        self.gpu_index = gpu_index
        self.samples: list[dict[str, float]] = []
        self._proc = psutil.Process()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml: Any = None
        self._handle: Any = None
        self.gpu_status = "not asked for" if gpu_index is None else "not started"
        self._t0 = 0.0

    def start(self) -> Sampler:
        if self._thread is not None:
            return self
        if self.gpu_index is not None:
            self._nvml, self._handle, self.gpu_status = _nvml_handle(self.gpu_index)
        # psutil's cpu_percent reports usage since the previous call; prime both counters so
        # the first real sample covers one interval instead of "since boot".
        psutil.cpu_percent(interval=None)
        self._proc.cpu_percent(interval=None)
        self._t0 = time.perf_counter()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="pitstop-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.samples.append(self._sample())

    def _sample(self) -> dict[str, float]:
        s: dict[str, float] = {
            "t": time.perf_counter() - self._t0,
            "cpu_percent": psutil.cpu_percent(interval=None),
            "process_cpu_percent": self._proc.cpu_percent(interval=None),
            "rss_bytes": float(self._proc.memory_info().rss),
        }
        children = 0
        try:
            for c in self._proc.children(recursive=True):
                # a worker may exit between listing and reading
                with contextlib.suppress(psutil.Error):
                    children += c.memory_info().rss
        except psutil.Error:
            pass
        s["children_rss_bytes"] = float(children)
        if self._handle is not None:
            nv = self._nvml
            try:
                s["gpu_util_percent"] = float(nv.nvmlDeviceGetUtilizationRates(self._handle).gpu)
                s["gpu_memory_bytes"] = float(nv.nvmlDeviceGetMemoryInfo(self._handle).used)
                s["gpu_power_watts"] = nv.nvmlDeviceGetPowerUsage(self._handle) / 1000.0
            except Exception as e:  # a query this GPU does not support: stop asking
                self.gpu_status = f"NVML query failed: {e}"
                self._handle = None
        return s

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=5 * self.interval_s + 1)
        self._thread = None
        if not self.samples:  # a run shorter than one interval still gets one sample
            self.samples.append(self._sample())
        if self._nvml is not None:
            with contextlib.suppress(Exception):  # shutting down NVML is best effort
                self._nvml.nvmlShutdown()
            self._nvml = None

    def summary(self) -> SamplerSummary:
        """The interval, sample count, GPU status and each metric's mean and max so far."""
        keys = sorted({k for s in self.samples for k in s} - {"t"})
        stats: dict[str, Stat] = {}
        for k in keys:  # the sample's own names (the class docstring), SamplerSummary's keys
            vals = [s[k] for s in self.samples if k in s]
            stats[k] = Stat(mean=sum(vals) / len(vals), max=max(vals))
        return SamplerSummary(
            interval_s=self.interval_s, samples=len(self.samples), gpu=self.gpu_status, **stats
        )

    def __enter__(self) -> Sampler:
        return self.start()

    def __exit__(self, *_: Any) -> None:
        self.stop()


def make_sampler(
    enabled: bool = True, interval_s: float = 0.5, gpu_index: int | None = None
) -> Sampler | NullSampler:
    """A `Sampler`, or a `NullSampler` when sampling is disabled."""
    return Sampler(interval_s, gpu_index) if enabled else NullSampler()
