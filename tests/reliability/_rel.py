"""Helpers of the reliability suite (not a test module): CLI runs, waiting, checking.

Every training run here is a real `python -m pitstop train` process with one
intra-op thread: one thread makes CPU reductions run in one fixed order, so an
interrupted-and-resumed run can be compared bit for bit with an uninterrupted one,
and it keeps the suite from fighting other jobs for the machine's two cores.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
BASE_STEPS = 8
SAVE_STEPS = 2
RUN_TIMEOUT = 300


def train_cmd(
    model: Path, store: Path, out: Path, *extra: str, steps: int = BASE_STEPS
) -> list[str]:
    return [
        sys.executable, "-m", "pitstop", "train", "--model", str(model), "--data", str(store),
        "--output", str(out), "--max-seq-len", "64", "--tokens-per-step", "128",
        "--micro-batch-size", "2", "--batching", "pack", "--max-steps", str(steps),
        "--log-steps", "1", "--save-steps", str(SAVE_STEPS), "--save-total-limit", "2",
        "--lr", "1e-3", "--report-to", "none", "--compile", "off",
        "--cache-dir", str(store.parent / "cache"), *extra,
    ]  # fmt: skip
    # One measured-choice cache per store (per test worker), shared by a test's runs and
    # their reference: a measured choice (the CPU precision) is made once and reused, as
    # on a user's machine, so a run and its reference never differ by a re-measurement.


def env(**extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("PITSTOP_TEST_")}
    e.update(
        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PITSTOP_PROGRESS="0",
    )  # fmt: skip
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e.update(extra)
    return e


def run(cmd: list[str], **env_extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, env=env(**env_extra), capture_output=True, text=True, timeout=RUN_TIMEOUT
    )


def start(cmd: list[str], **env_extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, env=env(**env_extra), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def reference_run(out: Path, model: Path, store: Path, steps: int) -> Path:
    done = run(train_cmd(model, store, out, steps=steps))
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def die_at(point: str) -> dict[str, str]:
    """The environment that makes a run SIGKILL itself at a named fault point (pitstop/core/faults.py)."""
    return {"PITSTOP_TEST_DIE_AT": point}


def hold_at(point: str, gate: Path) -> dict[str, str]:
    """A run that stops at `point` until `release(gate)`; `held(gate)` tells it got there."""
    return {"PITSTOP_TEST_HOLD_AT": point, "PITSTOP_TEST_HOLD_GATE": str(gate)}


def held(gate: Path) -> bool:
    return gate.with_name(gate.name + ".held").exists()


def release(gate: Path) -> None:
    gate.touch()


KILLED = -signal.SIGKILL  # returncode of a process that died at a fault point


def wait_until(
    cond: Callable[[], bool], proc: subprocess.Popen, what: str, timeout: float = 240
) -> bool:
    """Poll `cond` every 5 ms; False if the process ended first (it may legitimately finish)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            return cond()
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)
    return True


def sigkill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(60)
    if proc.stderr:
        proc.stderr.close()


def metric_lines(out: Path) -> list[dict]:
    """Complete lines of metrics.jsonl (a torn last line after a kill is not counted)."""
    p = out / "metrics.jsonl"
    if not p.is_file():
        return []
    lines = []
    for raw in p.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(ValueError):  # torn by the kill
            lines.append(json.loads(raw))
    return lines


def weights(d: Path) -> dict[str, torch.Tensor]:
    return load_file(d / "model.safetensors")


def check_accepted_checkpoints(out: Path) -> list[int]:
    """Every checkpoint discovery accepts must be whole: weights, optimizer, state, RNG, loader.

    Returns the accepted steps. This is the "never take a half-written checkpoint"
    guarantee: a directory the trainer would resume from must load completely.
    """
    from pitstop.train.checkpoint import complete_checkpoints, read_checkpoint

    steps = []
    for step, path in complete_checkpoints(out / "checkpoints"):
        assert path.name == f"step-{step}"
        json.loads((path / "config.json").read_text(encoding="utf-8"))
        w = weights(path)  # safetensors validates its header against the file length
        assert w and all(torch.isfinite(t).all() for t in w.values()), path
        st = read_checkpoint(path)
        assert st.trainer_state["step"] == step, path
        assert st.optimizer["optimizer"]["state"], path
        steps.append(step)
    return steps


def assert_same_as(out: Path, ref: Path, steps: int = BASE_STEPS) -> None:
    """Bit-identical to the reference: every step logged exactly once, same losses, same weights."""
    a, b = metric_lines(ref), metric_lines(out)
    assert [r["step"] for r in b] == list(range(1, steps + 1)), [r["step"] for r in b]
    for key in ("loss", "grad_norm", "lr", "trained_tokens", "seen_tokens"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    wa, wb = weights(ref / "final"), weights(out / "final")
    assert wa.keys() == wb.keys()
    differ = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not differ, f"final weights differ from the uninterrupted run: {differ[:5]}"
    s = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    assert s["status"] == "completed" and s["optimizer_steps"] == steps


def no_traceback(stderr: str) -> None:
    assert "Traceback" not in stderr, stderr[-3000:]
