"""Per-step phase timing: where each optimizer step's seconds go.

Phases: data_wait (waiting for the loader), host_to_device, forward, backward,
optimizer, checkpoint, eval, logging, and other (the rest of the step). On the
CPU every phase is a `time.perf_counter` interval, so the phases sum to the step
time exactly. On CUDA the device phases (host_to_device, forward, backward,
optimizer) are timed with CUDA events recorded into the stream: recording costs
no synchronisation, and the elapsed times are read only when the caller resolves
the step at a logging step, after it has synchronised anyway. Host phases
(data_wait, checkpoint, eval, logging) are always host clock.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

PHASES = (
    "data_wait",
    "host_to_device",
    "forward",
    "backward",
    "optimizer",
    "checkpoint",
    "eval",
    "logging",
    "other",
)
DEVICE_PHASES = frozenset({"host_to_device", "forward", "backward", "optimizer"})


@dataclass
class StepRecord:
    """One step's timing; `events` are unresolved CUDA event pairs per phase."""

    step_seconds: float
    host: dict[str, float]
    events: list[tuple[str, Any, Any]] = field(default_factory=list)

    def resolve(self) -> dict[str, float]:
        """Seconds per phase (every PHASES key), `other` being the unexplained rest.

        With CUDA events, call this only after the stream has been synchronised.
        """
        out = dict.fromkeys(PHASES, 0.0)
        for name, sec in self.host.items():
            out[name] += sec
        if self.events:
            for name in DEVICE_PHASES:
                out[name] = 0.0
            for name, start, end in self.events:
                out[name] += start.elapsed_time(end) / 1000.0
        named = sum(v for k, v in out.items() if k != "other")
        out["other"] = max(0.0, self.step_seconds - named)
        return out


class Timeline:
    """Times the phases of the current step; `end_step()` hands back a `StepRecord`."""

    def __init__(self, use_cuda_events: bool = False) -> None:
        self.use_cuda_events = use_cuda_events
        self._t0 = time.perf_counter()
        self._host: dict[str, float] = {}
        self._events: list[tuple[str, Any, Any]] = []

    def start_step(self) -> None:
        self._t0 = time.perf_counter()
        self._host = {}
        self._events = []

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a phase; repeated phases in one step (micro-batches) add up."""
        ev = None
        if self.use_cuda_events and name in DEVICE_PHASES:
            import torch

            ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            ev[0].record()
        t = time.perf_counter()
        try:
            yield
        finally:
            self._host[name] = self._host.get(name, 0.0) + time.perf_counter() - t
        # Reached only when the body returned. One that failed, perhaps with a CUDA error
        # that leaves the device unusable, must not have the end event recorded: that would
        # raise a second CUDA error over the one the caller must see. The unpaired start
        # event is dropped (the step is cut short and never resolved as a whole).
        if ev is not None:
            ev[1].record()
            self._events.append((name, ev[0], ev[1]))

    def add(self, name: str, seconds: float) -> None:
        """Charge `seconds` measured elsewhere to a phase of the current step."""
        self._host[name] = self._host.get(name, 0.0) + seconds

    def end_step(self) -> StepRecord:
        return StepRecord(time.perf_counter() - self._t0, self._host, self._events)

    def end_step_seconds(self) -> tuple[dict[str, float], str | None]:
        """The open step's seconds per phase, and why they are lost if they are.

        After a step cut short its CUDA events may never complete (or the device is in
        error): reading them raises, and that must neither hide the error that cut the
        step short nor stop the caller from recording what it has."""
        try:
            return self.end_step().resolve(), None
        except Exception as err:
            return {}, str(err)
