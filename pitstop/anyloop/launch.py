"""`pitstop profile -- CMD`: run a training command unchanged with the step timer attached.

The command runs in a child process whose Python start-up imports `boot/sitecustomize.py`
(this package's `boot` directory goes first on PYTHONPATH); that file calls
`attach_from_env`, which starts a `Watch` writing to the directory named in the
environment and stops it when the interpreter exits. Under `torchrun` every worker is
timed and rank 0 writes. The parent then prints what the child wrote.

Limits (each one documented in docs/profile-any-loop.md): a process that ends with
`os._exit` or a signal writes nothing; steps are counted by the first optimizer that
steps; tokens are counted from torch DataLoader batches only.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from pitstop.advise.profile_text import format_profile
from pitstop.anyloop.timer import Watch, install_excepthook
from pitstop.core import run_record
from pitstop.core.errors import ConfigError, DataError
from pitstop.core.process_group import run_with_limit
from pitstop.measure.schema import load_profile

ENV_OUTPUT = "PITSTOP_WATCH_OUTPUT"
ENV_WARMUP = "PITSTOP_WATCH_WARMUP"
ENV_COMMAND = "PITSTOP_WATCH_COMMAND"
ENV_CACHE = "PITSTOP_WATCH_CACHE_DIR"
BOOT_DIR = Path(__file__).resolve().parent / "boot"


def attach_from_env() -> Watch | None:
    """Child side: start a Watch configured by the environment; it writes at exit."""
    out = os.environ.get(ENV_OUTPUT)
    if not out:
        return None
    w = Watch(
        out,
        warmup_steps=int(os.environ.get(ENV_WARMUP) or 1),
        print_report=False,  # the parent prints, once, after every rank has finished
        cache_dir=os.environ.get(ENV_CACHE) or None,
        command=json.loads(os.environ.get(ENV_COMMAND) or "[]"),
    )
    w.start()
    install_excepthook(w)
    return w


def default_output(command: list[str]) -> Path:
    """runs/<script name>-<UTC time>: the first argument that names a .py file, else the program."""
    script = next((a for a in command[1:] if a.endswith(".py")), command[0] if command else "run")
    return Path("runs") / f"{Path(script).stem}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"


def check_command(command: list[str], output: Path) -> None:
    """Every problem with the command and the output directory, as one ConfigError."""
    problems = []
    if not command:
        problems.append(
            "give the training command after --, e.g. `pitstop profile -- python train.py`"
        )
    elif shutil.which(command[0]) is None:
        problems.append(f"{command[0]!r} is not a program on PATH (give the command to run)")
    if (output / run_record.SUMMARY).exists():
        problems.append(
            f"{output} already holds a run ({run_record.SUMMARY}); give a new --output "
            "directory (a profile never overwrites a run)"
        )
    if problems:
        raise ConfigError(
            problems, header=f"cannot profile the command ({len(problems)} problem(s)):"
        )


def run_command(
    command: list[str],
    output: str | os.PathLike[str],
    *,
    warmup_steps: int = 1,
    cache_dir: str | os.PathLike[str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    seconds: float | None = None,
) -> int:
    """Run `command` with the timer attached (rank 0 writes `output`); its exit status.

    With `seconds`, the command runs in a process group of its own, ended with everything
    it started once that time is spent (`TimeLimitReached`, pitstop.core.process_group)."""
    out = Path(output)
    check_command(command, out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env[ENV_OUTPUT] = str(out.resolve())
    env[ENV_WARMUP] = str(int(warmup_steps))
    env[ENV_COMMAND] = json.dumps(command)
    if cache_dir:
        env[ENV_CACHE] = str(cache_dir)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(BOOT_DIR)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    try:
        if seconds is not None:
            return run_with_limit(command, env=env, cwd=cwd, seconds=seconds)
        return subprocess.run(command, env=env, cwd=cwd, check=False).returncode
    except OSError as e:
        raise ConfigError(f"could not start {command[0]!r}: {e}") from None


def load_results(output: str | os.PathLike[str]) -> tuple[dict, dict | None]:
    """(profile, doctor report or None) that the child wrote to `output`."""
    out = Path(output)
    prof = out / run_record.HF_PROFILE
    if not (out / run_record.SUMMARY).is_file() or not prof.is_file():
        raise DataError(run_record.no_step_seen("the command", out))
    report = None
    findings = out / run_record.FINDINGS
    if findings.is_file():
        try:
            report = json.loads(findings.read_text(encoding="utf-8"))
        except ValueError:
            report = None
    return load_profile(prof), report


def format_results(profile: dict, report: dict | None) -> str:
    """The breakdown, verdict and findings, the same text PitstopCallback prints."""
    return format_profile(profile, report)
