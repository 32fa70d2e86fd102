"""`pitstop profile`: step-time breakdown, verdict and profile.json on the tiny Llama (CPU)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import pytest

from pitstop.measure.schema import load_profile, make_profile
from pitstop.measure.timeline import PHASES
from pitstop.profiling import format_profile, step_spread, window_utilisation

# --- fast: pure functions -------------------------------------------------------------


def test_step_spread_and_window_utilisation():
    sp = step_spread([1.0, 2.0, 3.0, 4.0, 100.0])
    assert sp["median_seconds"] == 3.0 and sp["min_seconds"] == 1.0 and sp["max_seconds"] == 100.0
    assert sp["p10_seconds"] < sp["median_seconds"] < sp["p90_seconds"]
    assert step_spread([]) == {}
    samples = [{"t": t, "cpu_percent": 10.0 * t} for t in (0.5, 1.0, 1.5, 2.0)]
    win = window_utilisation(samples, 0.9, 1.6)
    assert win["samples"] == 2 and win["cpu_percent"] == {"mean": 12.5, "max": 15.0}


def test_format_profile_reads_a_constructed_profile():
    phases = [dict.fromkeys(PHASES, 0.0) | {"forward": 0.3, "backward": 0.6, "data_wait": 0.1}] * 4
    prof = make_profile(phases, [1.0] * 4, warmup=1, source="pitstop", trained_tokens=400)
    text = format_profile(prof)
    assert "100 tokens/s" in text and "data_wait" in text and "verdict: input-bound" in text
    assert "median 1.0000 s" in text


# --- end to end on the tiny model ------------------------------------------------------


def _flags(model: Path, store: Path, cache: Path) -> list[str]:
    return [
        "--model", str(model), "--data", str(store), "--max-seq-len", "64",
        "--tokens-per-step", "256", "--batching", "pack", "--compile", "off",
        "--cache-dir", str(cache), "--loader-workers", "0",
    ]  # fmt: skip


def _cli(argv: list[str]) -> int:
    """The command as the CLI runs it (register + parse + func), without pitstop/cli.py's main."""
    from pitstop.commands.profile import register

    parser = argparse.ArgumentParser(prog="pitstop")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    args.unknown = []
    return args.func(args)


@pytest.mark.slow
def test_profile_cli_writes_a_loadable_profile_and_a_trace(
    tiny_model_dir, store, cache_dir, tmp_path, capsys
):
    out = tmp_path / "p" / "profile.json"
    trace = tmp_path / "trace"
    argv = ["profile", *_flags(tiny_model_dir, store, cache_dir), "--steps", "4", "--warmup", "1"]
    assert _cli([*argv, "--output", str(out), "--trace", str(trace)]) == 0
    printed = capsys.readouterr().out
    prof = load_profile(out)
    assert prof["schema"] == "pitstop.profile/1" and prof["source"] == "pitstop"
    assert prof["steps"] == 4 and prof["warmup"] == 1 and len(prof["step_seconds"]) == 4
    # the phases explain the measured steps' time (warm-up left out of both)
    assert sum(prof["phases"].values()) == pytest.approx(sum(prof["step_seconds"]), rel=1e-3)
    assert prof["tokens_per_second"] > 0 and prof["tokens_per_step"] > 0
    assert 0 < prof["mfu"] < 1 and prof["peak_memory_bytes"] > 0
    assert set(prof["events"]) == {"checkpoints", "evals", "logs"}
    assert prof["verdict"]["kind"] in ("compute-bound", "optimizer-bound", "sync-bound")
    assert prof["verdict"]["kind"] != "input-bound"
    for name in ("verdict:", "step time: median", "tokens/s", "MFU", "memory:", "backward"):
        assert name in printed, name
    assert list(trace.glob("trace-steps-*.json")), "no Chrome trace written"
    assert json.loads(next(trace.glob("*.json")).read_text())["traceEvents"]


class SlowLoader:
    """A real MicroBatchLoader whose every micro-batch arrives `delay` seconds late."""

    def __init__(self, inner: Any, delay: float) -> None:
        self.inner, self.delay = inner, delay
        self.settings = inner.settings
        self.steps_per_epoch = inner.steps_per_epoch
        self.total_steps = inner.total_steps

    def steps_in_epoch(self, epoch: int) -> int:
        return self.inner.steps_in_epoch(epoch)

    def resplit(self, settings: Any) -> None:
        self.inner.resplit(settings)

    def __iter__(self):
        for mb in self.inner:
            time.sleep(self.delay)  # a slow disk / tokenizer / transform
            yield mb

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


@pytest.mark.slow
def test_a_slow_loader_is_called_input_bound(tiny_model_dir, store, tmp_path):
    from _train_util import train_config

    from pitstop.batching.resolve import loader_for
    from pitstop.profiling import run_profile

    warmup, steps = 1, 3
    cfg = train_config(
        tiny_model_dir, store, tmp_path / "unused", tokens_per_step=128,
        micro_batch_size=None, tokens_per_micro_batch=128, max_steps=warmup + steps,
        loader_workers=0,
    )  # fmt: skip
    loader = SlowLoader(loader_for(store, cfg), delay=0.4)
    result = run_profile(cfg, steps=steps, warmup=warmup, loader=loader)
    prof = result.profile
    assert prof["verdict"]["kind"] == "input-bound"
    assert prof["phases"]["data_wait"] >= 0.4 * steps * 0.9
    assert prof["verdict"]["evidence"]["data_wait_share"] >= 0.05
    assert not (tmp_path / "unused").exists()  # the run went to a temporary directory


def test_tokens_per_second_is_what_the_recorded_seconds_say():
    # Seconds with digits below the microsecond the profile keeps: a reader recomputing
    # tokens/s from the recorded step seconds and eval phase must get the recorded figure
    # (CI once saw 1401.3918 recorded against 1401.3900 recomputed).
    steps = [0.1234567891 + i * 0.0000004444 for i in range(40)]
    evals = [0.0100004449 if i % 10 == 0 else 0.0 for i in range(40)]
    phases = [{"forward": s * 0.3, "eval": e} for s, e in zip(steps, evals, strict=True)]
    p = make_profile(phases, steps, warmup=1, source="test", trained_tokens=40 * 4096)
    training = sum(p["step_seconds"]) - p["phases"]["eval"]
    assert p["tokens_per_second"] == pytest.approx(40 * 4096 / training, rel=1e-12)
    assert p["tokens_per_second"] == pytest.approx(
        p["tokens_per_step"] * p["steps"] / training, rel=1e-12
    )


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        ({"step_seconds": [0.5, -0.2]}, "step_seconds holds a negative or non-finite time"),
        ({"step_seconds": [0.5, float("inf")]}, "step_seconds holds a negative or non-finite"),
        ({"phases": {"forward": -1.0}}, "phases forward: a negative or non-finite time"),
        ({"schema": "pitstop.profile/99"}, "schema 'pitstop.profile/99'; this pitstop reads"),
    ],
)
def test_a_profile_with_impossible_values_is_refused(tmp_path: Path, edit: dict, said: str) -> None:
    """A hand-edited profile with negative seconds gave estimate a time of -226,466 s and
    the doctor "0.0% of step time"; another schema was read as if it were this one."""
    from pitstop.core.errors import DataError
    from pitstop.measure.schema import check_profile

    good = make_profile([{"forward": 0.1}] * 2, [0.5, 0.5], warmup=1, source="pitstop")
    assert check_profile(json.loads(json.dumps(good))) is not None
    with pytest.raises(DataError, match=said.replace("(", r"\(")):
        check_profile({**good, **edit})
