"""A first-run measurement is spent only when the planned run repays it.

Before step 1 a first run may measure things a cost model could answer: the layout
(`batching: auto` timing pack against bucket), the micro-batch on a GPU (forward+backward
passes at 2 to 32 rows). On a run of hours that is noise; on the short runs people use to
try settings it was half the process (issue 46: 82 s against a 40-second bare loop on an
H200). So each measurement is weighed first, from estimates only:

- its cost: the forward+backward passes it would run, at the run's estimated seconds per
  position (FLOPs at an assumed MFU of the device's peak: `seconds_per_position`);
- what it can gain: the run's estimated seconds times the smallest gain the measurement
  could act on (`gain` of 5% for the layout; for the micro-batch, pitstop's basis);
- it is spent when the gain exceeds `MEASURE_PAYBACK` times its cost; else the cost model
  decides, and the banner names what was skipped, with these numbers.

A measurement that was spent is cached as before and reused by every later run of the
configuration, short or long; a skipped one is not cached (the next, longer run measures).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MEASURE_PAYBACK", "Payoff", "payoff", "seconds_per_position"]

# The estimated gain must exceed the measurement's estimated cost this many times: both are
# estimates (an assumed MFU), and a measurement skipped costs only its cost model's error.
MEASURE_PAYBACK = 3.0


@dataclass(frozen=True)
class Payoff:
    """A measurement weighed against what it can gain on this run (estimates, seconds)."""

    cost_s: float  # what the measurement would take
    run_s: float  # the planned run's estimated seconds (this process's share)
    gain: float  # the smallest relative gain the measurement could act on

    @property
    def saving_s(self) -> float:
        return self.run_s * self.gain

    @property
    def worth(self) -> bool:
        return self.saving_s > MEASURE_PAYBACK * self.cost_s

    def describe(self, what: str) -> str:
        verdict = "over" if self.worth else "less than"
        return (
            f"{what} would take ~{self.cost_s:.1f} s; a {self.gain:.0%} gain on the planned "
            f"~{self.run_s:.0f} s run saves ~{self.saving_s:.1f} s, {verdict} "
            f"{MEASURE_PAYBACK:g}x that"
        )

    def to_dict(self) -> dict[str, float | bool]:
        return {
            "cost_seconds": self.cost_s,
            "run_seconds": self.run_s,
            "gain": self.gain,
            "worth": self.worth,
        }


def payoff(cost_s: float, run_s: float, gain: float) -> Payoff:
    return Payoff(cost_s, run_s, gain)


def seconds_per_position(
    flops_per_position: float, peak_flops: float | None, mfu: float
) -> float | None:
    """The estimated seconds of one position's forward+backward: its FLOPs at `mfu` of the
    device's peak (None without a peak)."""
    if not peak_flops or flops_per_position <= 0:
        return None
    return flops_per_position / (peak_flops * mfu)
