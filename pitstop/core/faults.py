"""Fault injection for tests: every `PITSTOP_TEST_*` variable, read once, here alone.

A test that must crash, stall or poison a run at a precise moment sets one of these in
the environment of the process it starts; `from_env()` reads them once (when a run is
built) into a `Faults` object the run carries. Without any of them the object is
`NO_FAULTS`, whose checks do nothing (docs/style.md: a null object, not `if testing:`
through the loop). No other production module reads a `PITSTOP_TEST_*` variable
(tests/test_faults.py greps the package).

Named fault points (`POINTS`): where a process can be made to die (SIGKILL to itself,
the same as a kill from outside: no handler, no cleanup) or to hold until a test lets
it go. Dying at a named point instead of at a wall-clock guess is what makes a
crash test give the same answer on a fast machine and on a loaded one.

    PITSTOP_TEST_DIE_AT="POINT[:N]"   die at POINT (N: the step or checkpoint number)
    PITSTOP_TEST_HOLD_AT="POINT[:N]"  at POINT, create GATE.held and wait until GATE
    PITSTOP_TEST_HOLD_GATE=GATE       exists (a file path; needed with HOLD_AT)
    PITSTOP_TEST_STOP_AT_STEP=N       after step N, stop as SIGTERM would (checkpoint, exit)
    PITSTOP_TEST_NAN_STEPS=3,4        those steps' losses are NaN
    PITSTOP_TEST_OOM_ROWS=STEP:ROWS   in step STEP a micro-batch of more than ROWS rows
                                      raises a CUDA out-of-memory error
    PITSTOP_TEST_CKPT_FAIL=K          writing checkpoint K fails as if the disk were full
    PITSTOP_TEST_COMPILE_FAILS_ON_RANK=R  no real torch.compile: rank R's compiled forward
                                      fails as a failed compile does (train/compile.py)
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pitstop.core.errors import PitstopError

PREFIX = "PITSTOP_TEST_"

# name: what the process has just done when it reaches the point (N: what it counts).
POINTS: dict[str, str] = {
    "startup": "started; nothing loaded or measured yet",
    "measured": "decided the batch layout (measured or reused) and recorded it in the "
    "run directory; no step yet",
    "restored": "restored a checkpoint (--resume); no step of this life yet",
    "step": "run the first micro-batch's forward and backward of optimizer step N "
    "(1-based); no update yet",
    "ckpt-write": "written checkpoint N's files into its partial directory, not yet its "
    "COMPLETE marker",
    "ckpt-renamed": "renamed checkpoint N into place (complete), before pruning old ones",
    "final-write": "written final/'s files into its partial directory, not yet renamed "
    "into place (the last checkpoint may still be being written)",
    "export-write": "written the merged model's files (export --merge, --merge-lora) into its "
    "partial directory, not yet renamed into place",
    "prepare-chunk": "written chunk N's arrays (1-based, in input order) into the token "
    "store's partial directory; no manifest yet",
}
HOLD_SECONDS_MAX = 600.0  # a held process whose test died goes on by itself


@dataclass(frozen=True)
class FaultPoint:
    name: str
    n: int | None = None  # None: any (or no) number

    def matches(self, name: str, n: int | None) -> bool:
        return name == self.name and (self.n is None or self.n == n)

    def __str__(self) -> str:
        return self.name if self.n is None else f"{self.name}:{self.n}"


@dataclass(frozen=True)
class Faults:
    """The faults a test asked for; the default asks for none."""

    die_at: FaultPoint | None = None
    hold_at: FaultPoint | None = None
    hold_gate: Path | None = None
    stop_at_step: int | None = None
    nan_steps: frozenset[int] = field(default_factory=frozenset)
    oom_rows: tuple[int, int] | None = None  # (step, rows)
    ckpt_fail: int | None = None
    compile_fails_on_rank: int | None = None

    def reached(self, name: str, n: int | None = None) -> None:
        """The process is at fault point `name` (number `n`): die or hold if asked to."""
        if self.die_at is not None and self.die_at.matches(name, n):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.hold_at is not None and self.hold_at.matches(name, n):
            assert self.hold_gate is not None  # from_env requires it
            held = self.hold_gate.with_name(self.hold_gate.name + ".held")
            held.write_text(f"{name}:{n} pid {os.getpid()}\n", encoding="utf-8")
            deadline = time.monotonic() + HOLD_SECONDS_MAX
            while not self.hold_gate.exists() and time.monotonic() < deadline:
                time.sleep(0.02)

    def poisons(self, step: int) -> bool:
        """Whether optimizer step `step` (1-based) gets a NaN loss."""
        return step in self.nan_steps

    def stops_after(self, step: int) -> bool:
        return self.stop_at_step is not None and step == self.stop_at_step

    def out_of_memory(self, step: int, rows: int) -> bool:
        """Whether a micro-batch of `rows` rows in step `step` (1-based) must fail."""
        return self.oom_rows is not None and self.oom_rows[0] == step and rows > self.oom_rows[1]

    def fails_checkpoint(self, step: int) -> bool:
        return self.ckpt_fail is not None and self.ckpt_fail == step


NO_FAULTS = Faults()


def _point(var: str, text: str) -> FaultPoint:
    name, _, n = text.partition(":")
    if name not in POINTS or (n and not n.isdigit()):
        raise PitstopError(
            f"{var}={text!r}: expected POINT or POINT:N, POINT one of {', '.join(POINTS)}"
        )
    return FaultPoint(name, int(n) if n else None)


def _int(var: str, text: str) -> int:
    if not text.strip().isdigit():
        raise PitstopError(f"{var}={text!r}: expected a whole number")
    return int(text)


# The variables `from_env` reads, without the prefix: any other is a typo, refused.
_KNOWN = frozenset(
    {
        "DIE_AT",
        "HOLD_AT",
        "HOLD_GATE",
        "STOP_AT_STEP",
        "NAN_STEPS",
        "OOM_ROWS",
        "CKPT_FAIL",
        "COMPILE_FAILS_ON_RANK",
    }
)


def from_env(environ: Mapping[str, str] | None = None) -> Faults:
    """The faults the environment asks for (`NO_FAULTS` when none)."""
    source = os.environ if environ is None else environ
    env = {k: v for k, v in source.items() if k.startswith(PREFIX) and v}
    if not env:
        return NO_FAULTS
    unknown = sorted(k for k in env if k[len(PREFIX) :] not in _KNOWN)
    if unknown:
        raise PitstopError(
            f"unknown test fault variable(s) {', '.join(unknown)}; known: "
            + ", ".join(PREFIX + k for k in sorted(_KNOWN))
        )

    def get(key: str) -> str | None:
        return env.get(PREFIX + key)

    hold = get("HOLD_AT")
    gate = get("HOLD_GATE")
    if hold and not gate:
        raise PitstopError(f"{PREFIX}HOLD_AT needs {PREFIX}HOLD_GATE (the file that releases it)")
    oom = get("OOM_ROWS")
    if oom is not None:
        step, _, rows = oom.partition(":")
        oom_rows = (_int(PREFIX + "OOM_ROWS", step), _int(PREFIX + "OOM_ROWS", rows))
    nan = get("NAN_STEPS") or ""
    return Faults(
        die_at=_point(PREFIX + "DIE_AT", v) if (v := get("DIE_AT")) else None,
        hold_at=_point(PREFIX + "HOLD_AT", hold) if hold else None,
        hold_gate=Path(gate) if gate else None,
        stop_at_step=_int(PREFIX + "STOP_AT_STEP", v) if (v := get("STOP_AT_STEP")) else None,
        nan_steps=frozenset(_int(PREFIX + "NAN_STEPS", s) for s in nan.split(",") if s),
        oom_rows=oom_rows if oom is not None else None,
        ckpt_fail=_int(PREFIX + "CKPT_FAIL", v) if (v := get("CKPT_FAIL")) else None,
        compile_fails_on_rank=_int(PREFIX + "COMPILE_FAILS_ON_RANK", v)
        if (v := get("COMPILE_FAILS_ON_RANK"))
        else None,
    )
