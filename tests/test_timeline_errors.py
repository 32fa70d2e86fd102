"""A device phase whose body raises must let that error out, not a second one from its timing.

On CUDA a phase records an end event when it closes. After a CUDA error in the body (an
illegal address, a device-side assert) the device is unusable and recording raises again;
raised from the phase's exit, that second error would replace the one that says what went
wrong. Here (CPU) a stand-in for torch.cuda.Event raises as CUDA's does once the "device"
has failed.
"""

from __future__ import annotations

import pytest
import torch

from pitstop.measure.timeline import Timeline


class DeviceFailed(RuntimeError):
    """The body's own error: what the caller must see."""


class FakeEvent:
    """torch.cuda.Event's surface the timeline uses; `record` raises after a device error."""

    broken = False
    recorded = 0

    def __init__(self, enable_timing: bool = False) -> None:
        self.t = 0.0

    def record(self) -> None:
        if FakeEvent.broken:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        FakeEvent.recorded += 1
        self.t = float(FakeEvent.recorded)

    def elapsed_time(self, end: FakeEvent) -> float:  # milliseconds, as CUDA's
        return (end.t - self.t) * 1000.0


@pytest.fixture
def cuda_events(monkeypatch):
    FakeEvent.broken, FakeEvent.recorded = False, 0
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)


def test_the_bodys_error_comes_out_not_the_end_events(cuda_events):
    tl = Timeline(use_cuda_events=True)
    tl.start_step()
    with pytest.raises(DeviceFailed, match="the step's own error"), tl.phase("forward"):
        FakeEvent.broken = True  # the kernel failed: the device is now in error
        raise DeviceFailed("the step's own error")
    assert FakeEvent.recorded == 1  # the start event only: nothing touched the device after
    assert tl.end_step().events == []  # no unpaired event left to resolve
    assert "forward" in tl.end_step().host  # the host clock still charged the phase


def test_a_phase_that_completes_still_records_its_events(cuda_events):
    tl = Timeline(use_cuda_events=True)
    tl.start_step()
    with tl.phase("forward"):
        pass
    with tl.phase("data_wait"):  # a host phase: no events
        pass
    rec = tl.end_step()
    assert [name for name, _, _ in rec.events] == ["forward"]
    assert rec.resolve()["forward"] == pytest.approx(1.0)  # events 1 and 2: one "second"
