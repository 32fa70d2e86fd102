"""The machine's load next to a measurement.

Another busy process makes step times erratic and slower; a figure measured on a loaded
machine says so (the tune report, a run's summary.json, the callback's profile), and
`estimate --from-profile` quotes it with the rate it extrapolates from.

Two measures. The 1-minute load average is what every platform has, but it counts the run's
own threads and lags a minute behind. Where psutil can read the machine's CPU times, the
CPU time *other* processes took while the run ran is measured directly: the machine's busy
time minus this process tree's (its threads and loader workers), in cores, over the window
from `cpu_snapshot()` to `machine_load(since=...)`; on a virtual machine, the time the
hypervisor gave to other guests (steal) beside it. A steadily shared CPU shows there even
when every step is equally slow, which erratic step times alone would miss.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Any, TypedDict

# Other processes using at least this share of the machine's cores during a measurement
# make its figures "measured on a shared machine" (pitstop's threshold, not a measurement:
# background daemons use a few hundredths of a core).
SHARED_CORE_SHARE = 0.2


@dataclass(frozen=True)
class CpuSnapshot:
    """The machine's and this process tree's CPU seconds at one moment."""

    t: float  # time.monotonic()
    busy: float  # all cores: user + nice + system + irq + softirq seconds
    steal: float  # seconds the hypervisor ran other guests instead of this machine
    own: float  # this run's process tree: threads, loader workers, torchrun's other ranks
    cores: int  # the machine's logical cores (what the busy seconds are spread over)


class OtherCpu(TypedDict, total=False):
    """What other processes (and other guests) used of the machine during a measurement
    (empty where no window was measured)."""

    other_cores: float
    steal_cores: float
    window_seconds: float
    machine_cores: int


class MachineLoad(OtherCpu, total=False):
    """The machine a figure was measured on, as profiles and summaries record it ("machine").

    A record read back from a file may lack any key (older runs recorded only the load
    average, or nothing) or hold a hand-edited value: the readers below check each one."""

    load_average_1m: float | None
    cpu_cores: int | None


def _run_root(psutil: Any) -> Any:
    """The process whose tree is this run: this process, or under torchrun (which starts every
    local rank as a child of its agent) the agent, so the run's other ranks are not "others"."""
    me = psutil.Process()
    if "TORCHELASTIC_RUN_ID" in os.environ and int(os.environ.get("LOCAL_WORLD_SIZE") or 1) > 1:
        return me.parent() or me
    return me


def cpu_snapshot() -> CpuSnapshot | None:
    """Now, or None where psutil cannot read the CPU times (the load average remains)."""
    try:
        import psutil

        m = psutil.cpu_times()
        me = _run_root(psutil)
        own = sum(me.cpu_times()[:4])  # user, system, children_user, children_system
        for child in me.children(recursive=True):
            with contextlib.suppress(psutil.Error):  # exited between the listing and the read
                own += sum(child.cpu_times()[:2])
        busy = sum(getattr(m, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq"))
        cores = psutil.cpu_count() or 1
        return CpuSnapshot(time.monotonic(), busy, getattr(m, "steal", 0.0), own, cores)
    except Exception:  # no /proc, a sandbox: measure without it
        return None


def other_cpu(since: CpuSnapshot | None, now: CpuSnapshot | None) -> OtherCpu:
    """Cores other processes (and other guests: steal) used between two snapshots."""
    if since is None or now is None or now.t - since.t <= 0:
        return OtherCpu()
    wall = now.t - since.t
    others = max(0.0, (now.busy - since.busy) - (now.own - since.own)) / wall
    steal = max(0.0, now.steal - since.steal) / wall
    return OtherCpu(
        other_cores=round(min(others, now.cores), 3),
        steal_cores=round(min(steal, now.cores), 3),
        window_seconds=round(wall, 3),
        machine_cores=now.cores,
    )


def machine_load(since: CpuSnapshot | None = None) -> MachineLoad:
    """{"load_average_1m", "cpu_cores"} of this machine now and, given the snapshot taken when
    the measurement began, {"other_cores", "steal_cores", "window_seconds", "machine_cores"}
    (see the module docstring)."""
    try:
        load: float | None = os.getloadavg()[0]
    except (OSError, AttributeError):  # not available on this platform
        load = None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    out = MachineLoad(load_average_1m=load, cpu_cores=cores)
    if since is not None:
        out.update(other_cpu(since, cpu_snapshot()))
    return out


def shared_by_others(machine: MachineLoad | None) -> str | None:
    """ "other processes used 1.0 of 2 cores" when they used at least SHARED_CORE_SHARE of the
    machine while a figure was measured (steal counted with them); else None."""
    machine = machine or MachineLoad()
    try:
        used = float(machine.get("other_cores") or 0) + float(machine.get("steal_cores") or 0)
        cores = int(machine.get("machine_cores") or 0)
    except (TypeError, ValueError):  # a hand-edited record: say nothing rather than guess
        return None
    if cores <= 0 or used < SHARED_CORE_SHARE * cores:
        return None
    steal = float(machine.get("steal_cores") or 0)
    extra = f" ({steal:.1f} of it stolen by the hypervisor)" if steal >= 0.05 else ""
    return f"other processes used {used:.1f} of {cores} cores{extra}"


def loaded_by_average(machine: MachineLoad | None, per_core: float = 1.0) -> str | None:
    """ "load 3.2 on 2 cores" when the 1-minute load average reached `per_core` x the cores
    and nothing better was measured; else None. The load average counts the run's own
    processes (its loader workers, its ranks), so where the others' CPU time was measured
    (`other_cores`, `shared_by_others`) that decides instead."""
    machine = machine or MachineLoad()
    if machine.get("other_cores") is not None:
        return None
    load, cores = machine.get("load_average_1m"), machine.get("cpu_cores")
    ok = isinstance(load, (int, float)) and isinstance(cores, (int, float)) and cores > 0
    if not ok or load < per_core * cores:  # type: ignore[operator]
        return None
    return f"load {load:.1f} on {cores:.0f} cores"


def describe_load(machine: MachineLoad | None) -> str | None:
    """ "load 3.2 on 2 cores" (None when unknown): what a figure was measured under."""
    machine = machine or MachineLoad()
    shared = shared_by_others(machine)
    if machine.get("load_average_1m") is None or not machine.get("cpu_cores"):
        return shared
    load = f"load {machine['load_average_1m']:.1f} on {machine['cpu_cores']} cores"
    return f"{load}; {shared}" if shared else load
