"""The real-client suite (issue 44): pitstop on the training programs people actually run.

Each program in tests/clients/ is written the way its users write it (a nanoGPT-style loop,
an accelerate loop, a Lightning script, a Hugging Face Trainer script with a padding
collator) and TRL's own `trl.scripts.sft` runs as shipped. Each runs under
`pitstop profile --` as a user would, and every assertion compares pitstop's figures with a
truth computed without pitstop:

- tokens per optimizer step and the optimizer steps: counted by the program from its own
  batches (`--truth FILE`);
- the evaluation's share: the program's own clock around its evaluations (nanoGPT's loss
  estimate, Lightning's validation hooks, the Trainer's logged `eval_runtime`), within 15
  points. The same figure against a second run with evaluation off needs a quiet machine
  (two runs' speeds differ as much on a shared one): `python -m bench.clients` measures it
  (bench/results/clients.md);
- the padding share: counted by the program from the attention masks of its batches;
- MFU: within (0, 100%], also when the CPU's peak was first measured beside two busy loops.

Slow: every run is a Python process that imports torch and transformers (and trl,
datasets, lightning, accelerate). Run alone with `make test-clients`.
"""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing as mp
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from pitstop import cli
from pitstop.measure.verdict import EVAL_MODERATE, verdict

CLIENTS = Path(__file__).resolve().parent / "clients"
pytestmark = [pytest.mark.slow, pytest.mark.clients]
EVAL_POINTS = 0.15  # the eval share may differ from the truth by this much (issue 44)
EVAL_BAND = 0.05  # a truth this close to the eval-bound threshold allows either verdict


def profile(out: Path, *command: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """`pitstop profile --output OUT -- COMMAND` run as a user runs it, in its own process;
    the run's files and everything the command printed."""
    argv = [sys.executable, "-m", "pitstop", "profile", "--output", str(out), "--", *command]
    proc = subprocess.run(
        argv, env={**os.environ, **(env or {})}, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return {
        "summary": json.loads((out / "summary.json").read_text()),
        "profile": json.loads((out / "pitstop_profile.json").read_text()),
        "findings": json.loads((out / "findings.json").read_text())["findings"],
        "stdout": proc.stdout + proc.stderr,
        "dir": out,
    }


def share(run: dict[str, Any], phase: str) -> float:
    p = run["profile"]
    return p["phases"].get(phase, 0.0) / sum(p["step_seconds"])


def truth(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def ids(run: dict[str, Any]) -> list[str]:
    return [f["id"] for f in run["findings"]]


# Each program's runs, made once per test process: under xdist a module fixture is torn down
# and set up again whenever the worker's queue runs dry between two tests that use it.
_RUNS: dict[str, dict[str, Any]] = {}


def once(name: str, make: Any) -> dict[str, Any]:
    if name not in _RUNS:
        _RUNS[name] = make()
    return _RUNS[name]


def _spin(stop: Any) -> None:
    while not stop.is_set():
        pass


@contextlib.contextmanager
def busy_cores(n: int = 2) -> Iterator[None]:
    """`n` busy loops, one process each, for the block's duration."""
    stop = mp.get_context("fork").Event()
    procs = [mp.get_context("fork").Process(target=_spin, args=(stop,)) for _ in range(n)]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        stop.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


# --- a nanoGPT-style loop -------------------------------------------------------------------


@pytest.fixture
def nanogpt(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    def make() -> dict[str, Any]:
        d = tmp_path_factory.mktemp("nanogpt")
        runs = {}
        for name, every in (("eval", "10"), ("plain", "0")):
            cmd = [sys.executable, str(CLIENTS / "nanogpt_loop.py"), "--out", str(d / name)]
            cmd += ["--max-iters", "30", "--eval-interval", every, "--eval-iters", "40"]
            cmd += ["--truth", str(d / f"{name}.json")]
            runs[name] = profile(d / f"run-{name}", *cmd)
            runs[name]["truth"] = truth(d / f"{name}.json")
        return runs

    return once("nanogpt", make)


@pytest.mark.xdist_group("nanogpt")
def test_nanogpt_tokens_steps_and_mfu_without_a_dataloader(nanogpt: dict[str, Any]) -> None:
    run = nanogpt["plain"]
    s, t = run["summary"], run["truth"]
    assert s["optimizer_steps"] == t["steps"] == 30
    # batch 8 x block 64 x accumulation 2, counted by the program from its own batches
    assert set(t["tokens_per_step"]) == {8 * 64 * 2}
    assert s["trained_tokens_per_step"] == pytest.approx(8 * 64 * 2, rel=0.02)
    assert s["tokens_per_second"] > 0 and s["flops_per_token"] > 0
    assert 0 < s["mfu"] <= 1.0
    assert s["config"]["per_device_train_batch_size"] == 8
    assert s["config"]["gradient_accumulation_steps"] == 2


@pytest.mark.xdist_group("nanogpt")
def test_nanogpt_estimate_from_profile_works(nanogpt: dict[str, Any]) -> None:
    err = io.StringIO()
    with redirect_stdout(io.StringIO()), redirect_stderr(err):
        rc = cli.main(["estimate", "--from-profile", str(nanogpt["plain"]["dir"]), "--gpu", "H100"])
    assert rc == 0, err.getvalue()


@pytest.mark.xdist_group("nanogpt")
def test_nanogpt_evaluation_is_its_own_phase_and_the_top_finding(nanogpt: dict[str, Any]) -> None:
    run, plain = nanogpt["eval"], nanogpt["plain"]
    # The truth: the loop's own clock around its loss estimates, over the same iterations.
    expected = run["truth"]["eval_seconds"] / run["truth"]["seconds"]
    assert share(run, "eval") == pytest.approx(expected, abs=EVAL_POINTS)
    assert run["profile"]["events"]["evals"] >= 2
    assert run["profile"]["events"]["eval_forwards"] >= 2 * 80  # 40 batches of each split
    # Evaluation batches are not trained tokens: the same tokens per step as without it.
    assert run["summary"]["trained_tokens_per_step"] == plain["summary"]["trained_tokens_per_step"]
    top = next(f for f in run["findings"] if f["id"] != "noisy-machine")
    assert top["id"] == "eval-overhead" and "every 10 steps" in top["title"]
    assert "eval_interval" in top["fix"]
    assert not any("log" in f["fix"].lower() for f in run["findings"])
    # The verdict against the loop's own clock, not against what evaluation usually costs: on
    # a quiet machine it is ~40% of these steps, but a neighbour that stalls the 0.6 s of
    # training for seconds can push the truth under the verdict's threshold (seen once in CI
    # beside another test). Near the threshold either reading is right.
    kind = verdict(run["profile"]).kind
    if expected >= EVAL_MODERATE + EVAL_BAND:
        assert kind in ("eval-bound", "noisy-machine"), (expected, kind)
    elif expected < EVAL_MODERATE - EVAL_BAND:
        assert kind != "eval-bound", (expected, kind)


# --- an accelerate loop, and a Trainer script, whose collators pad ----------------------------


@pytest.mark.xdist_group("small")
def test_accelerate_loop_steps_and_padding(tiny_model_dir: Path, tmp_path: Path) -> None:
    cmd = [sys.executable, str(CLIENTS / "accelerate_loop.py"), str(tiny_model_dir)]
    run = profile(tmp_path / "run", *cmd, "--steps", "20", "--truth", str(tmp_path / "t.json"))
    t = truth(tmp_path / "t.json")
    assert run["summary"]["optimizer_steps"] == t["steps"] == 20
    assert run["profile"]["program"] == "accelerate"
    assert run["summary"]["padding_waste"] == pytest.approx(t["padding_share"], abs=1e-9)
    f = {x["id"]: x for x in run["findings"]}["packing-off"]
    assert f["evidence"]["padding_fraction"] == pytest.approx(t["padding_share"], abs=0.05)
    assert "pack the rows" in f["fix"] and "which tokens form a step" in f["fix"]


@pytest.mark.xdist_group("small")
def test_trainer_script_padding_in_training_arguments_terms(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cmd = [sys.executable, str(CLIENTS / "trainer_padding.py"), str(tiny_model_dir)]
    cmd += [str(tmp_path / "out"), "--steps", "10", "--truth", str(tmp_path / "t.json")]
    run = profile(tmp_path / "run", *cmd)
    t = truth(tmp_path / "t.json")
    assert run["summary"]["optimizer_steps"] == t["steps"] == 10
    assert run["profile"]["program"] == "trainer"
    assert run["summary"]["padding_waste"] == pytest.approx(t["padding_share"], abs=1e-9)
    assert "packing-off" in ids(run)
    for f in run["findings"]:  # a Trainer script's fixes are TrainingArguments fields
        assert "DataLoader(" not in f["fix"] and "torch.autocast" not in f["fix"], f


# --- a Lightning script -----------------------------------------------------------------------


@pytest.fixture
def lightning(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("lightning")

    def make() -> dict[str, Any]:
        d = tmp_path_factory.mktemp("lightning")
        runs = {}
        for name, every in (("val", "10"), ("plain", "0")):
            cmd = [sys.executable, str(CLIENTS / "lightning_loop.py"), str(tiny_model_dir)]
            cmd += ["--steps", "30", "--val-every", every, "--val-batches", "16"]
            runs[name] = profile(d / name, *cmd, "--truth", str(d / f"{name}.json"))
            runs[name]["truth"] = truth(d / f"{name}.json")
        return runs

    return once("lightning", make)


@pytest.mark.xdist_group("lightning")
def test_lightning_backward_is_backward_and_validation_is_eval(lightning: dict[str, Any]) -> None:
    run, plain = lightning["val"], lightning["plain"]
    assert run["summary"]["optimizer_steps"] == run["truth"]["steps"] == 30
    assert run["profile"]["program"] == "lightning"
    # The closure Lightning runs inside optimizer.step(closure) is forward and backward: the
    # optimizer's share is the update alone, below backward's.
    for r in (run, plain):
        assert share(r, "backward") > share(r, "optimizer")
        assert share(r, "forward") > 0.05
    expected = run["truth"]["val_seconds"] / run["truth"]["seconds"]  # Lightning's hooks
    assert share(run, "eval") == pytest.approx(expected, abs=EVAL_POINTS)
    assert run["profile"]["events"]["eval_forwards"] == 3 * 16  # at steps 10, 20, 30
    v = verdict(run["profile"])
    assert "optimizer-bound" not in {v.kind} | {a.kind for a in v.also}
    for f in run["findings"]:
        assert f["id"] not in ("optimizer-bound", "sync-bound", "logging-overhead"), f
    ev = {f["id"]: f for f in run["findings"]}.get("eval-overhead")
    assert ev is None or "L.Trainer(val_check_interval=" in ev["fix"]


# --- TRL's own SFT script ---------------------------------------------------------------------


def _trl_data(d: Path) -> Path:
    sys.path.insert(0, str(CLIENTS))
    from _common import prompt_completion_data

    return prompt_completion_data(d / "data")


def trl_command(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "trl.scripts.sft", "--model_name_or_path", str(model),
        "--dataset_name", str(data), "--per_device_train_batch_size", "4", "--max_length", "512",
        "--max_steps", "10", "--output_dir", str(out), "--report_to", "none",
        "--save_strategy", "no", "--logging_steps", "5", "--bf16", "False", "--seed", "0",
        *extra,
    ]  # fmt: skip


TRL_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "PITSTOP_TEST_CPU_FLAGS": "avx512_bf16",  # a CPU with native bf16 (faked where none)
}


@pytest.fixture
def trl(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("trl")

    def make() -> dict[str, Any]:
        d = tmp_path_factory.mktemp("trl")
        data = _trl_data(d)
        runs: dict[str, Any] = {"data": data, "dir": d}
        # The first run on a fresh cache, beside two busy loops: the CPU peak is measured busy.
        env = {**TRL_ENV, "PITSTOP_CACHE_DIR": str(d / "cache")}
        model = tiny_model_dir
        with busy_cores(2):
            runs["busy"] = profile(d / "busy", *trl_command(model, data, d / "o1"), env=env)
        runs["plain"] = profile(d / "plain", *trl_command(model, data, d / "o2"), env=env)
        cmd = trl_command(model, data, d / "o3", "--eval_strategy", "steps")
        cmd += ["--eval_steps", "5", "--per_device_eval_batch_size", "4"]
        runs["eval"] = profile(d / "eval", *cmd, env=env)
        return runs

    return once("trl", make)


@pytest.mark.xdist_group("trl")
def test_trl_mfu_is_never_impossible_after_a_busy_first_run(trl: dict[str, Any]) -> None:
    for name in ("busy", "plain", "eval"):
        mfu = trl[name]["summary"]["mfu"]
        notes = trl[name]["profile"]["notes"]
        assert (mfu is not None and 0 < mfu <= 1.0) or any("MFU not" in n for n in notes), name
    cached = list((trl["dir"] / "cache").rglob("cpu_peak*.json"))
    assert cached  # the busy measurement was cached marked busy, or replaced by a quiet one


@pytest.mark.xdist_group("trl")
def test_trl_padding_bf16_and_fixes_in_sftconfig_terms(trl: dict[str, Any]) -> None:
    run = trl["plain"]
    assert run["profile"]["program"] == "trainer"
    found = {f["id"]: f for f in run["findings"]}
    pad = found["packing-off"]
    assert pad["evidence"]["padding_fraction"] >= 0.2
    assert "padding_free=True" in pad["fix"] and "packing=True" in pad["fix"]
    bf16 = found["fp32-on-bf16-cpu"]
    assert bf16["evidence"]["bf16_speedup"] > 0 and "at this model's shapes" in bf16["title"]
    assert "bf16=True" in bf16["fix"]
    for f in run["findings"]:  # TrainingArguments / SFTConfig fields, never loop code
        assert "DataLoader(" not in f["fix"] and "torch.autocast" not in f["fix"], f


@pytest.mark.xdist_group("trl")
def test_trl_evaluation_is_a_phase_and_its_batches_are_not_trained(trl: dict[str, Any]) -> None:
    run, plain = trl["eval"], trl["plain"]
    assert run["profile"]["events"]["evals"] == 2  # steps 5 and 10
    assert run["profile"]["events"]["eval_forwards"] == 2 * 15  # 60 test rows / 4
    # The evaluation's batches are not trained tokens: the same tokens as the run without it.
    assert run["summary"]["trained_tokens"] == plain["summary"]["trained_tokens"]
    # The Trainer's own clock: the eval_runtime it logs for each evaluation, over its
    # train_runtime (the steps pitstop measured leave out the first, a warm-up).
    logged = [float(x) for x in re.findall(r"'eval_runtime': '?([0-9.]+)", run["stdout"])]
    train = float(re.findall(r"'train_runtime': '?([0-9.]+)", run["stdout"])[-1])
    assert len(logged) == 2
    assert share(run, "eval") == pytest.approx(sum(logged) / train, abs=EVAL_POINTS)
    # Throughput is training's: evaluation's seconds are left out of tokens/s and MFU.
    p = run["profile"]
    training = sum(p["step_seconds"]) - p["phases"]["eval"]
    assert p["tokens_per_second"] == pytest.approx(p["tokens_per_step"] * p["steps"] / training)
    assert verdict(run["profile"]).kind != "sync-bound"


@pytest.mark.xdist_group("trl")
def test_trl_tune_tries_bf16_the_loader_and_the_batch_changes(
    trl: dict[str, Any], tiny_model_dir: Path
) -> None:
    d = trl["dir"]
    cmd = trl_command(tiny_model_dir, trl["data"], d / "o4")
    # One pair per fix: each is measured once, with its band (a verdict needs two pairs,
    # and a tiny model's steps on 2 cores are too noisy for one to be reached reliably).
    argv = ["tune", "--output", str(d / "tune"), "--steps", "4", "--budget-seconds", "1800"]
    argv += ["--max-pairs", "1", "--allow-batch-changes", "--", *cmd]
    with pytest.MonkeyPatch.context() as mp_:
        for k, v in {**TRL_ENV, "PITSTOP_CACHE_DIR": str(d / "cache")}.items():
            mp_.setenv(k, v)
        with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
            assert cli.main(argv) == 0
    res = json.loads((d / "tune" / "tuned_settings.json").read_text())
    tried = {r["fix"]: r for r in res["results"]}
    assert {"bf16=True", "dataloader_num_workers=1", "packing=True", "padding_free=True"} <= set(
        tried
    ), sorted(tried)
    assert tried["bf16=True"]["math"] == "same math up to precision"
    assert tried["packing=True"]["math"] == tried["padding_free=True"]["math"]
    for name in ("bf16=True", "dataloader_num_workers=1", "packing=True", "padding_free=True"):
        r = tried[name]
        assert r["error"] is None and r["rounds"] == 1, r
        j = r["judgement"]
        assert j["low"] <= j["ratio"] <= j["high"]  # measured, with its band
    assert os.path.isdir(d / "tune")
