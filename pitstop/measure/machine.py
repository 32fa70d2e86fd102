"""The machine's load next to a measurement.

Another busy process makes step times erratic and slower; a figure measured on a loaded
machine says so (the tune report, a run's summary.json, the callback's profile), and
`estimate --from-profile` quotes it with the rate it extrapolates from.
"""

from __future__ import annotations

import os
from typing import Any


def machine_load() -> dict[str, Any]:
    """{"load_average_1m": float | None, "cpu_cores": int | None} of this machine now."""
    try:
        load: float | None = os.getloadavg()[0]
    except (OSError, AttributeError):  # not available on this platform
        load = None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"load_average_1m": load, "cpu_cores": cores}


def describe_load(machine: dict[str, Any] | None) -> str | None:
    """ "load 3.2 on 2 cores" (None when unknown): what a figure was measured under."""
    machine = machine or {}
    if machine.get("load_average_1m") is None or not machine.get("cpu_cores"):
        return None
    return f"load {machine['load_average_1m']:.1f} on {machine['cpu_cores']} cores"
