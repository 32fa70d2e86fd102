"""Range checks of every number in a RunConfig, kept apart from `config.validate`'s
cross-field checks (validate calls `range_problems`), and the range of every other
command's numeric flags (`FLAG_RANGES`, checked by `flag_problems`).

A NaN passes every `x <= 0` test and an infinity most others, and torch accepts both
until something breaks far from the flag: `--lr nan` trains nothing, `--save-minutes nan`
never saves, `--max-grad-norm nan` turns clipping off. So every float must be finite,
and each number is held to the range where it means something.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from pitstop.core.errors import short_repr

# Far above any real count of steps, tokens or rows, and still exact in a float and an
# int64: a bigger number is a typo that would overflow somewhere deep in numpy or torch.
MAX_COUNT = 2**53
# Range checks already in `validate` that a NaN or an infinity fails (no second message).
_CHECKED_IN_VALIDATE = {"min_lr_ratio"}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def range_problems(cfg: Any) -> list[str]:
    # `cfg` is a RunConfig; not imported here, as config imports this module
    """One message per number outside its range (validate's own checks are not repeated)."""
    p: list[str] = []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if isinstance(v, float) and not math.isfinite(v) and f.name not in _CHECKED_IN_VALIDATE:
            p.append(f"{_flag(f.name)} must be a finite number, got {short_repr(v)}")
        elif isinstance(v, float) and f.name in FLAG_RANGES and v > FLAG_RANGES[f.name].hi:
            p.append(parse_flag(f.name, v)[1] or "")  # 1e30: finite and absurd
        elif isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_COUNT:
            if f.name == "seed":  # not a count: its own range (int64) is checked below
                continue
            p.append(f"{_flag(f.name)} is {short_repr(v)}; it must be at most {MAX_COUNT:,}")

    def finite(name: str) -> float | None:
        v = getattr(cfg, name)
        return v if v is not None and math.isfinite(v) else None

    if (wd := finite("weight_decay")) is not None and wd < 0:
        p.append(f"--weight-decay must be 0 (off) or positive, got {wd}")
    if (drop := finite("lora_dropout")) is not None and not 0 <= drop < 1:
        p.append(f"--lora-dropout is a probability: at least 0 and below 1, got {drop}")
    if (alpha := finite("lora_alpha")) is not None and alpha <= 0:
        p.append(f"--lora-alpha must be positive, got {alpha}")
    if cfg.warmup_steps is not None and cfg.warmup_steps < 0:
        p.append(f"--warmup-steps must be 0 (no warm-up) or more, got {cfg.warmup_steps}")
    # The loader only uses prefetch_factor with worker processes (loader_workers None may
    # choose some), where torch refuses anything below 1 with a traceback.
    if cfg.prefetch_factor < 1 and cfg.loader_workers != 0:
        p.append(
            f"--prefetch-factor must be at least 1 with loader workers, got {cfg.prefetch_factor}"
        )
    if not 0 <= cfg.seed < 2**63:
        p.append(f"--seed must be between 0 and 2**63 - 1, got {short_repr(cfg.seed)}")
    return p


# --- the numeric flags of the commands outside RunConfig -------------------------------------
#
# `estimate`, `compare`, `report`, `doctor`, `demo`, and `profile`'s and `tune`'s own options
# are not RunConfig fields, so `range_problems` never sees them; `--params nan` used to hang
# the estimate and `--mfu nan` printed "Time: nan h". Each flag's range lives here, once,
# and `flag_problems` checks them (each command's `run` first, via
# `commands.flags.check_number_flags`; argparse `type=` would refuse in its own words).

MAX_PARAMS = 1e15  # 1,000x the largest models trained today; more is a typo (1e30)
MAX_PRICE = 1000.0  # USD per GPU-hour: ~100x any cloud's price for one GPU
MAX_GPUS = 1_000_000
MAX_SEQ_LEN = 2**24  # 16M positions per row
MAX_STEPS_FLAG = 10_000_000  # steps a demo, profile or tune trial would run in one command


@dataclass(frozen=True)
class FlagRange:
    """What a number given to a flag may be: `lo`..`hi` (`lo` itself excluded when
    `lo_open`), an integer when `integer`, a comma-separated list of such when `many`;
    `fix` says what the number is, with an example."""

    lo: float
    hi: float
    fix: str
    integer: bool = False
    lo_open: bool = False
    many: bool = False

    def describe(self) -> str:
        if self.many:
            kind = f"a comma-separated list of {'integers' if self.integer else 'numbers'}"
        else:
            kind = "an integer" if self.integer else "a number"
        if self.lo_open:
            return f"{kind} above {_num(self.lo)} and at most {_num(self.hi)}"
        return f"{kind} from {_num(self.lo)} to {_num(self.hi)}"


def _num(x: float) -> str:
    """1e15 and 10,000,000 rather than 1e+15 and 1e+07; 2**53 digit for digit."""
    if not float(x).is_integer():
        return f"{x:g}"
    if x >= 1e8 and math.log10(x).is_integer():
        return f"1e{int(math.log10(x))}"
    return f"{int(x):,}"


# Flag name (argparse's dest) -> its range; the commands that take each are in COMMAND_FLAGS.
FLAG_RANGES: dict[str, FlagRange] = {
    "params": FlagRange(1, MAX_PARAMS, "the model's parameter count, e.g. 7e9"),
    "tokens": FlagRange(1, MAX_COUNT, "tokens per epoch, e.g. 1e9", integer=True),
    "epochs": FlagRange(1e-6, 1e6, "passes over the data, e.g. 1 or 0.5"),
    "max_seq_len": FlagRange(8, MAX_SEQ_LEN, "positions per row, e.g. 2048", integer=True),
    "mfu": FlagRange(1e-3, 1, "a fraction of the GPU's peak, e.g. 0.4"),
    "price_per_gpu_hour": FlagRange(0, MAX_PRICE, "USD per GPU-hour, e.g. 2.5"),
    "lora_r": FlagRange(1, 65536, "the LoRA rank, e.g. 16", integer=True),
    "micro_batch_size": FlagRange(1, 2**20, "rows per micro-batch, e.g. 4", integer=True),
    "headroom": FlagRange(0, 0.9, "the fraction of GPU memory kept free, e.g. 0.1"),
    "scaling_efficiency": FlagRange(0.01, 1, "speed-up kept per doubling of GPUs, e.g. 0.9"),
    "gpu_tflops": FlagRange(1e-3, 1e6, "dense peak TFLOP/s of one GPU, e.g. 989"),
    "gpu_memory_gib": FlagRange(0.1, 1e4, "one GPU's memory in GiB, e.g. 80"),
    "save_steps": FlagRange(1, MAX_COUNT, "optimizer steps between checkpoints", integer=True),
    "tokens_per_step": FlagRange(1, MAX_COUNT, "positions per optimizer step", integer=True),
    "disk_write_gbps": FlagRange(1e-3, 1e4, "checkpoint write speed in GB/s, e.g. 0.5"),
    # RunConfig floats held below an absurd value here too (range_problems; their lower
    # bounds are `validate`'s and range_problems' own)
    # lr: far above any real learning rate, yet finite ones up to it run: a run that blows
    # up is stopped by the non-finite guards (tests/reliability/test_finite_weights.py
    # trains at 1e9 on purpose), not refused at the door.
    "lr": FlagRange(0, 1e10, "a learning rate, e.g. 2e-5", lo_open=True),
    "weight_decay": FlagRange(0, 100, "0 (off) or a decay, e.g. 0.1"),
    "max_grad_norm": FlagRange(0, 1e6, "0 (no clipping) or a norm, e.g. 1.0"),
    "lora_alpha": FlagRange(0, 1e6, "the LoRA scale's numerator, e.g. 32", lo_open=True),
    "save_minutes": FlagRange(0, 1e7, "minutes between checkpoints, e.g. 30"),
    "max_record_seconds": FlagRange(0, 1e7, "0 (no limit) or seconds per record, e.g. 60"),
    "gpus": FlagRange(1, MAX_GPUS, "GPU counts, e.g. 1,2,4,8", integer=True, many=True),
    "rerun": FlagRange(1, 1000, "times to rerun each run, e.g. 3", integer=True),
    "nproc": FlagRange(1, MAX_GPUS, "processes (GPUs) of the run, e.g. 8", integer=True),
    "cpus": FlagRange(1, 1_000_000, "CPU cores of the machine, e.g. 32", integer=True),
    "max_steps": FlagRange(1, MAX_STEPS_FLAG, "optimizer steps, e.g. 80", integer=True),
    "steps": FlagRange(1, MAX_STEPS_FLAG, "measured steps, e.g. 20", integer=True),
    "warmup": FlagRange(0, MAX_STEPS_FLAG, "steps left out first, e.g. 3", integer=True),
    "budget_seconds": FlagRange(0, 30 * 86400, "seconds for the search, e.g. 600", lo_open=True),
    "memory_cap_gb": FlagRange(0, 1e5, "memory a trial may use in GB, e.g. 40", lo_open=True),
    "trial_warmup": FlagRange(0, MAX_STEPS_FLAG, "steps left out per trial, e.g. 2", integer=True),
    "trial_steps": FlagRange(1, MAX_STEPS_FLAG, "measured steps per trial, e.g. 30", integer=True),
    "max_pairs": FlagRange(1, 100, "baseline/trial pairs per fix, e.g. 3", integer=True),
}

# Each command's numeric flags outside RunConfig (the RunConfig flags of prepare, train,
# profile and tune are checked by `range_problems`).
COMMAND_FLAGS: dict[str, tuple[str, ...]] = {
    "estimate": (
        "params", "tokens", "epochs", "max_seq_len", "mfu", "price_per_gpu_hour", "lora_r",
        "micro_batch_size", "headroom", "scaling_efficiency", "gpu_tflops", "gpu_memory_gib",
        "save_steps", "tokens_per_step", "disk_write_gbps", "gpus",
    ),
    "compare": ("price_per_gpu_hour", "rerun"),
    "report": ("price_per_gpu_hour",),
    "doctor": ("nproc", "cpus", "lora_r"),
    "demo": ("max_steps",),
    "profile": ("steps", "warmup"),
    "tune": ("budget_seconds", "memory_cap_gb", "trial_warmup", "trial_steps", "steps", "max_pairs"),
}  # fmt: skip


def parse_flag(name: str, raw: Any) -> tuple[Any, str | None]:
    """Flag `name`'s value as a number (a list of them for a `many` flag; `1_000` and `7e9`
    allowed) and None, or None and the one-line problem: the flag, the value, the range
    and what to give instead. NaN, infinities and values out of range are problems."""
    r = FLAG_RANGES[name]
    items = str(raw).split(",") if r.many else [raw]
    values: list[float | int] = []
    for item in items:
        try:
            v: float | int = float(str(item).strip().replace("_", ""))
            ok = math.isfinite(v) and (v > r.lo if r.lo_open else v >= r.lo) and v <= r.hi
            if ok and r.integer:
                ok = float(v).is_integer()
                v = int(v)
        except (ValueError, OverflowError):
            ok = False
        if not ok:
            got = str(raw) if len(str(raw)) <= 40 else str(raw)[:37] + "..."
            return None, f"{_flag(name)} {got}: must be {r.describe()}; give {r.fix}"
        values.append(v)
    return (values if r.many else values[0]), None


def flag_problems(args: Any, command: str) -> list[str]:
    """Check every numeric flag of `command` given in `args` (an argparse Namespace),
    replacing each valid value by its number; one problem per invalid flag."""
    problems = []
    for name in COMMAND_FLAGS.get(command, ()):
        raw = getattr(args, name, None)
        if raw is None:
            continue
        value, problem = parse_flag(name, raw)
        if problem:
            problems.append(problem)
        else:
            setattr(args, name, value)
    return problems
