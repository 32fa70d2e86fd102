"""Fast unit tests of the training loop's parts: loss math, schedule, optimizer groups, probe,
timeline, FLOPs, checkpoint discovery and output-dir protection."""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pitstop.core.errors import ConfigError
from pitstop.measure.flops import flops_model
from pitstop.measure.timeline import PHASES, Timeline
from pitstop.probe import (
    COMPILE_SECONDS_BASIS,
    Choice,
    CompileSpeed,
    DeviceInfo,
    choose_attention,
    choose_compile,
    choose_precision,
    choose_tf32,
    median_lower_bound,
)
from pitstop.train import checkpoint as ckpt
from pitstop.train.optim import param_groups
from pitstop.train.schedule import lr_at

CPU = DeviceInfo(type="cpu", name="test cpu", cpu_count=2)
V100 = DeviceInfo(type="cuda", name="Tesla V100-SXM2-16GB", capability=(7, 0), bf16=False)
A100 = DeviceInfo(type="cuda", name="NVIDIA A100-SXM4-80GB", capability=(8, 0), bf16=True)


class _Loader:
    """A minimal loader honouring the contract (pitstop.batching.loader.Loader): fixed
    micro-batches, resumable; no settings, so it is never re-split."""

    settings = None

    def __init__(self, micro: list[dict], steps: int = 1) -> None:
        self.micro, self.steps_per_epoch, self.total_steps, self.pos = micro, steps, steps, 0

    def steps_in_epoch(self, epoch: int) -> int:
        return self.steps_per_epoch

    def resplit(self, settings):
        raise AssertionError("a loader without settings is never re-split")

    def __iter__(self):
        while self.pos < self.total_steps:
            yield from self.micro
            self.pos += 1

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, s):
        self.pos = s["pos"]


def _micro_batches(n: int, b: int, t: int, vocab: int, seed: int = 0) -> list[dict]:
    """n micro-batches [b, t] of two packed documents per row, some positions not targets."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, vocab, (b, t), generator=g)
        cut = t // 3
        pos = torch.cat([torch.arange(cut), torch.arange(t - cut)]).expand(b, t).clone()
        labels = ids.clone()
        labels[:, 0] = -100
        labels[:, cut] = -100  # a document's first token is never a target
        labels[:, cut + 1 : cut + 4] = -100  # a masked prompt
        out.append({"input_ids": ids, "labels": labels, "position_ids": pos})
    return out


def test_grad_accum_of_four_micro_batches_equals_one_big_batch(tiny_model_dir, tmp_path):
    from _train_util import train_config

    from pitstop.train.trainer import Trainer

    micro = _micro_batches(4, 2, 32, 4000)
    targets = sum(int((m["labels"][:, 1:] != -100).sum()) for m in micro)
    cfg = train_config(tiny_model_dir, tmp_path / "none", tmp_path / "out")
    tr = Trainer.from_config(cfg, device=CPU, loader=_Loader(micro))
    tl = Timeline()
    tl.start_step()
    loss_acc = sum(tr.forward_backward(m, targets, tl) for m in micro)
    accum = {n: p.grad.clone() for n, p in tr.run.model.named_parameters()}
    tr.run.model.zero_grad(set_to_none=True)
    big = {k: torch.cat([m[k] for m in micro]) for k in micro[0]}  # [8, 32]
    loss_big = tr.forward_backward(big, targets, tl)
    assert torch.allclose(loss_acc, loss_big, rtol=1e-6, atol=1e-6)
    for n, p in tr.run.model.named_parameters():
        assert torch.allclose(accum[n], p.grad, rtol=1e-5, atol=1e-7), n


def test_lr_schedule_shape():
    kw = {"peak_lr": 1.0, "total_steps": 100, "warmup_steps": 10, "min_lr_ratio": 0.1}
    cos = [lr_at(s, schedule="cosine", **kw) for s in range(100)]
    assert cos[0] == pytest.approx(0.1) and cos[9] == pytest.approx(1.0)
    assert all(a < b for a, b in itertools.pairwise(cos[:10]))  # rises through warm-up
    assert all(a >= b for a, b in itertools.pairwise(cos[10:]))  # then never rises
    assert cos[-1] == pytest.approx(0.1)
    assert cos[55] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 45 / 89)))
    lin = [lr_at(s, schedule="linear", **kw) for s in range(100)]
    assert lin[-1] == pytest.approx(0.1) and lin[10] == pytest.approx(1.0)
    assert lin[30] - lin[31] == pytest.approx(lin[60] - lin[61])  # straight line
    const = [lr_at(s, schedule="constant", **kw) for s in range(10, 100)]
    assert set(const) == {1.0}


def test_no_weight_decay_on_norms_and_biases():
    model = torch.nn.Sequential(
        torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)
    )
    groups = param_groups(model, 0.1)
    decayed = {id(p) for p in groups[0]["params"]}
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    for p in model.parameters():
        assert (id(p) in decayed) == (p.ndim >= 2)


def test_probe_precision_tf32_attention_compile():
    assert choose_precision("auto", CPU).value == "fp32"
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        choose_precision("bf16", CPU)
    with pytest.raises(ConfigError):
        choose_precision("fp16", CPU)
    assert choose_precision("auto", V100).value == "fp16"
    assert "GradScaler" in choose_precision("auto", V100).reason
    assert choose_precision("auto", A100).value == "bf16"
    with pytest.raises(ConfigError, match="no bf16"):
        choose_precision("bf16", V100)
    assert choose_tf32(A100, "bf16").value is True and choose_tf32(CPU, "fp32").value is False
    att = choose_attention("auto", CPU, "fp32")
    assert att.value == "sdpa_docs" and "CUDA" in att.reason
    with pytest.raises(ConfigError):
        choose_attention("flash_attention_2", CPU, "fp32")
    short = choose_compile("auto", CPU, 60.0)
    assert short.value is False and f"{COMPILE_SECONDS_BASIS:.0f} s compile" in short.reason
    assert short.measured["estimated_run_seconds"] == 60.0
    long = choose_compile("auto", CPU, 10 * 3600.0)
    assert long.value is True and "measures both" in long.reason
    assert choose_compile("off", CPU, 1e9).value is False
    assert choose_compile("on", CPU, 1.0).value is True


def test_compile_auto_decides_by_the_measured_payoff():
    """With this configuration's measurement, the planned steps' saving against the compile
    time decides, and the reason gives the numbers; the estimate is not used."""
    speed = CompileSpeed(30.0, 1.0, 0.8, "reused (cached)")  # saves 0.2 s a step
    few = choose_compile("auto", CPU, 1e9, steps=100, measured=speed)  # 20 s < 1.5 x 30 s
    assert few.value is False and "saves" not in few.reason and "would save ~20 s" in few.reason
    assert "a 30.0 s compile" in few.reason and "1.25x" in few.reason
    assert few.measured["steps"] == 100 and few.measured["compile_seconds"] == 30.0
    many = choose_compile("auto", CPU, 1.0, steps=1000, measured=speed)  # 200 s > 45 s
    assert many.value is True and "saves ~200 s" in many.reason
    slower = CompileSpeed(10.0, 1.0, 1.1, "measured")
    assert choose_compile("auto", CPU, 1e9, steps=10**6, measured=slower).value is False
    # --compile on and off are not decisions: the measurement does not change them.
    assert choose_compile("on", CPU, 1.0, steps=1, measured=slower).value is True
    assert choose_compile("off", CPU, 1e9, steps=10**6, measured=speed).value is False


def test_the_median_bound_covers_the_true_median_nine_times_in_ten():
    """`median_lower_bound` against the truth it claims: draws from a skewed distribution
    of known median, the bound at or under it in at least 90% of 4,000 samples of each size
    (exact order-statistic coverage: 87.5% for 3, 96.7% for 11, 95.3% for 23), and tighter
    than the smallest value once there are enough draws."""
    rng = random.Random(7)
    true_median = math.exp(0.05)  # of exp(N(0.05, 0.08)): ratios near 1.05, skewed
    for n, coverage in ((3, 0.875), (11, 0.967), (23, 0.953)):
        covered, above_min = 0, 0
        for _ in range(4000):
            xs = tuple(math.exp(rng.gauss(0.05, 0.08)) for _ in range(n))
            bound = median_lower_bound(xs, 0.9)
            covered += bound <= true_median
            above_min += bound > min(xs)
        assert covered / 4000 == pytest.approx(coverage, abs=0.015)
        assert (above_min > 0) == (n > 3)
    with pytest.raises(ValueError):
        median_lower_bound((), 0.9)


def test_compile_auto_decides_on_the_gain_the_pairs_show_with_confidence():
    """The same median gain (1.06x) and compile (30 s): steady pairs repay it over 1,000
    steps of 1 s; scattered pairs, some of them under 1x, do not show a gain with 90%
    confidence, so `auto` stays eager however long the run, and says why."""
    steady = (1.05, 1.06, 1.07, 1.06, 1.05, 1.06, 1.07, 1.06, 1.06, 1.05, 1.07)
    scattered = (0.97, 1.14, 1.06, 0.99, 1.12, 1.06, 1.01, 1.15, 1.06, 0.98, 1.10)
    assert statistics.median(steady) == statistics.median(scattered) == 1.06
    for ratios, compiles in ((steady, True), (scattered, False)):
        speed = CompileSpeed(30.0, 1.0, 1.0 / 1.06, "measured", ratios)
        choice = choose_compile("auto", CPU, 1.0, steps=1000, measured=speed)
        assert choice.value is compiles, choice.reason
        assert speed.saving(1000) == pytest.approx(1000 * (1 - 1 / 1.06))  # ~57 s either way
        assert "the median of 11 pairs" in choice.reason and "90% confidence" in choice.reason
    steady_speed = CompileSpeed(30.0, 1.0, 1.0 / 1.06, "m", steady)
    scattered_speed = CompileSpeed(30.0, 1.0, 1.0 / 1.06, "m", scattered)
    assert steady_speed.gain_floor == 1.05 and scattered_speed.gain_floor == 0.99
    assert steady_speed.to_dict()["speedup_floor"] == 1.05
    # A real gain still has to repay the compile: 400 steps save ~23 s of a 30 s compile.
    few = choose_compile("auto", CPU, 1.0, steps=400, measured=steady_speed)
    assert few.value is False and "would save ~23 s, less than the compile time" in few.reason
    # No measurable gain: eager however long the run.
    never = choose_compile("auto", CPU, 1.0, steps=10**6, measured=scattered_speed)
    assert never.value is False and "not measurably faster" in never.reason
    assert "0.99x or less" in never.reason


def test_the_basis_repays_three_times_one_compile():
    """Without a measurement: 3000 s at the basis's 1.2x saves 500 s, over 3x one 40 s
    compile; 300 s saves 50 s, under it."""
    assert choose_compile("auto", CPU, 3000.0).value is True
    assert choose_compile("auto", CPU, 300.0).value is False


def test_compile_timing_pairs_each_eager_step_with_its_compiled_neighbours(tmp_path):
    """A host warming up: steps 10% slow at first, 1% less each step until the tenth; eager
    steps of 1.0 s and compiled ones of 0.8 s after, the first eager step after compiled
    ones 0.3 s more (eager's memory faulted back in). Two eager steps timed before the
    compile against three compiled ones after it (the first way) would say 1.29x; a lone
    eager step against its compiled neighbours (the second way) 1.6x; the second of two
    eager steps against the compiled steps around them says 1.25x, the truth, and keeps
    saying it as later pairs join."""
    from pitstop.train.compile_record import (
        FIRST_STEPS,
        LATER_EVERY,
        LATER_PAIRS,
        CompileTiming,
        cached_speed,
        eager_steps,
        is_eager,
    )

    key = {"model": "m", "n": 1}
    timing = CompileTiming(key, tmp_path)

    def warm(i: int) -> float:
        return 1 + 0.01 * max(0, 10 - i)

    got = []
    for i in range(FIRST_STEPS + LATER_EVERY * LATER_PAIRS + 5):
        now = timing.eager_now()
        seconds = (1.0 if now else 0.8) * warm(i) + (9.0 if i == 0 else 0.0)
        seconds += 40.0 if i == 1 else 0.0  # the first compiled step holds the compile
        seconds += 0.3 if now and i > 1 and not is_eager(i - 1) else 0.0  # memory back
        got.append((now, timing.clock_now(), timing.step_done(seconds)))
        if timing.done():
            break
    eager_at = [i for i, (now, _, _) in enumerate(got) if now]
    later = [FIRST_STEPS - 1 + LATER_EVERY * k for k in range(1, LATER_PAIRS + 1)]
    assert eager_at == [0, 3, 4, 6, 7, 9, 10, *(w + d for w in later for d in (0, 1))]
    assert eager_at == [i for i in range(len(got)) if is_eager(i)]
    assert eager_steps(len(got)) == len(eager_at) and eager_steps(10) == 6
    assert len(got) == later[-1] + 3, "timing stops after the last pair's compiled step"
    # only the steps around a pair end with a device sync, and the ones before them
    clocked = {i for i, (_, clock, _) in enumerate(got) if clock}
    assert clocked == set(range(FIRST_STEPS)) | {w + d for w in later for d in range(-2, 3)}
    emitted = [(i, speed) for i, (_, _, speed) in enumerate(got) if speed is not None]
    assert [i for i, _ in emitted] == [FIRST_STEPS - 1] + [w + 2 for w in later]
    for n, (_, speed) in enumerate(emitted, start=3):
        # the first pairs' compiled steps sit 2 and 1 steps from the eager one: 0.5% off
        assert speed.pairs == n and speed.gain == pytest.approx(1.25, abs=0.01)
        assert speed.compile_s == pytest.approx(40.0, abs=0.05)
    assert emitted[-1][1].gain == pytest.approx(1.25)  # the later pairs', once warm
    first = emitted[0][1]
    assert first.eager_step_s == pytest.approx(1.03)  # the median of steps 4, 7 and 10
    # the first and second ways' figures on the same steps, for the docstring's claim
    old = statistics.median([1.0 * warm(i) for i in (1, 2)]) / statistics.median(
        [0.8 * warm(i) for i in (4, 5, 6)]
    )
    assert old == pytest.approx(1.29, abs=0.01)
    lone = [(1.0 * warm(i) + 0.3) / (0.8 * (warm(i - 1) + warm(i + 1)) / 2) for i in later]
    assert statistics.median(lone) == pytest.approx(1.625)
    cached = cached_speed(tmp_path, key)  # the next run of the configuration reads it back
    assert cached.pairs == 3 + LATER_PAIRS and "reused (cached in" in cached.source
    assert cached.gain == pytest.approx(1.25) and cached.compile_s == pytest.approx(40, abs=0.05)
    assert cached.gain_floor == pytest.approx(1.25, abs=1e-3)  # its ratios came back with it
    assert cached_speed(tmp_path, {**key, "n": 2}) is None  # another configuration


def test_timeline_phases_sum_to_step_time():
    tl = Timeline()
    tl.start_step()
    for name, sec in (
        ("data_wait", 0.01),
        ("forward", 0.02),
        ("backward", 0.02),
        ("optimizer", 0.01),
    ):
        with tl.phase(name):
            time.sleep(sec)
    time.sleep(0.01)  # unexplained time
    rec = tl.end_step()
    phases = rec.resolve()
    assert set(phases) == set(PHASES)
    assert sum(phases.values()) == pytest.approx(rec.step_seconds, rel=0.02)
    assert phases["other"] >= 0.005


def test_flops_per_token_matches_the_formula(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    fm = flops_model(model)
    n_all = sum(p.numel() for p in model.parameters())
    n_emb = model.get_input_embeddings().weight.numel()
    assert fm.n_trainable == n_all - n_emb and fm.n_frozen == 0
    assert fm.per_token(128) == 6 * (n_all - n_emb) + 12 * 2 * 64 * 128


def _fake_checkpoint(root: Path, step: int, *, complete: bool = True) -> Path:
    p = root / f"step-{step}"
    p.mkdir(parents=True)
    (p / "weights.bin").write_bytes(b"x" * 10)
    if complete:
        (p / ckpt.MARKER).write_text(json.dumps({"step": step, "files": {"weights.bin": 10}}))
    return p


def test_checkpoint_discovery_ignores_incomplete(tmp_path):
    root = tmp_path / "checkpoints"
    _fake_checkpoint(root, 2)
    _fake_checkpoint(root, 6, complete=False)  # no marker: a crash before the rename
    damaged = _fake_checkpoint(root, 4)
    (damaged / "weights.bin").write_bytes(b"x")  # size differs from the marker
    (root / ".step-8.partial-abcd").mkdir()
    assert ckpt.latest_checkpoint(root) == root / "step-2"
    ckpt.remove_debris(root)
    assert not (root / ".step-8.partial-abcd").exists()


def test_checkpoint_writer_is_atomic_and_keeps_the_newest(tmp_path):
    root = tmp_path / "checkpoints"

    def save_model(dest: Path, state: dict) -> None:
        from safetensors.torch import save_file

        save_file(state, dest / "model.safetensors")

    w = ckpt.CheckpointWriter(root, keep=2, save_model=save_model)
    for step in (1, 2, 3):
        snap = ckpt.Snapshot(step, {"w": torch.full((3,), float(step))}, {"optimizer": {}},
                             {"step": step}, ckpt.rng_state(), {"pos": step})  # fmt: skip
        w.submit(snap)
    w.wait()
    assert [s for s, _ in ckpt.complete_checkpoints(root)] == [2, 3]
    assert not [p for p in root.iterdir() if p.name.startswith(".")]
    state = ckpt.read_checkpoint(root / "step-3")
    assert state.loader_state == {"pos": 3} and state.trainer_state["step"] == 3


def test_rng_state_round_trips():
    st = ckpt.rng_state()
    a = (torch.rand(3), __import__("random").random(), __import__("numpy").random.rand())
    ckpt.set_rng_state(json.loads(json.dumps(st)))
    b = (torch.rand(3), __import__("random").random(), __import__("numpy").random.rand())
    assert torch.equal(a[0], b[0]) and a[1:] == b[1:]


def test_position_keyed_optimizer_state_is_renamed_for_fsdp():
    """A one-process checkpoint's optimizer state (keyed 0, 1, ...) keyed by parameter name,
    the format FSDP2 loads; a checkpoint of another model is a CheckpointError."""
    from pitstop.train.distributed import optimizer_state_by_name

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    saved = opt.state_dict()
    named = optimizer_state_by_name(model, opt, saved)
    groups = [g["params"] for g in named["param_groups"]]
    assert groups == [["0.weight"], ["0.bias", "1.weight", "1.bias"]]  # decay, no decay
    for i, name in enumerate(n for g in groups for n in g):
        assert named["state"][name]["exp_avg"] is saved["state"][i]["exp_avg"]
    assert optimizer_state_by_name(model, opt, named) is named  # already by name
    other = torch.optim.AdamW(param_groups(torch.nn.Linear(3, 4), 0.1), lr=1e-3)
    with pytest.raises(ckpt.CheckpointError, match=r"groups of \[1, 1\] tensors"):
        optimizer_state_by_name(model, opt, other.state_dict())


def test_output_dir_holding_a_run_is_refused(tiny_model_dir, store, tmp_path):
    from _train_util import train_config

    from pitstop.train import run

    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    before = sorted(p.name for p in out.rglob("*"))
    with pytest.raises(ConfigError, match="already holds a run") as e:
        run(train_config(tiny_model_dir, store, out))
    assert e.value.exit_code == 2
    assert sorted(p.name for p in out.rglob("*")) == before


def test_cpu_fp16_is_a_config_error_before_anything_is_written(tiny_model_dir, store, tmp_path):
    from _train_util import train_config

    from pitstop.train import run

    out = tmp_path / "out"
    with pytest.raises(ConfigError, match="CUDA"):
        run(train_config(tiny_model_dir, store, out, precision="fp16"), device=CPU)
    assert not out.exists()


def test_choice_serialises():
    assert Choice(True, "why").to_dict() == {"value": True, "reason": "why"}


class _Plant:
    """Unpickling this would create `path`: proof that code ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def _written_checkpoint(root: Path) -> Path:
    def save_model(dest: Path, state: dict) -> None:
        from safetensors.torch import save_file

        save_file(state, dest / "model.safetensors")

    w = ckpt.CheckpointWriter(root, keep=2, save_model=save_model)
    w.submit(ckpt.Snapshot(1, {"w": torch.ones(3)}, {"optimizer": {}}, {"step": 1},
                           ckpt.rng_state(), {"pos": 1}), blocking=True)  # fmt: skip
    return root / "step-1"


def test_a_pickle_in_a_checkpoint_is_a_checkpoint_error_naming_the_file(tmp_path):
    path = _written_checkpoint(tmp_path / "checkpoints")
    marker = tmp_path / "PWNED"
    torch.save(_Plant(marker), path / "optimizer.pt")
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.read_checkpoint(path)
    assert not marker.exists()
    msg = str(e.value)
    assert str(path) in msg and "optimizer.pt" in msg and "not a pitstop checkpoint file" in msg


def test_a_checkpoint_without_safetensors_is_a_checkpoint_error(tmp_path):
    from pitstop.train.model_io import load_weights

    path = _written_checkpoint(tmp_path / "checkpoints")
    (path / "model.safetensors").unlink()
    with pytest.raises(ckpt.CheckpointError, match="no safetensors weights"):
        load_weights(torch.nn.Linear(3, 1), path)


def test_a_failed_write_on_a_full_disk_names_the_disk(tmp_path, monkeypatch):
    import shutil

    usage = shutil.disk_usage(tmp_path)

    def save_model(dest: Path, state: dict) -> None:  # what torch.save says on a full disk
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    root = tmp_path / "checkpoints"
    w = ckpt.CheckpointWriter(root, keep=2, save_model=save_model)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda _p: usage._replace(free=4096))
    snap = ckpt.Snapshot(1, {"w": torch.ones(1 << 16)}, {"optimizer": {}}, {"step": 1},
                         ckpt.rng_state(), {"pos": 1})  # fmt: skip
    with pytest.raises(ckpt.CheckpointError) as e:
        w.submit(snap, blocking=True)
    assert f"the disk holding {root} is full (0 MB free)" in str(e.value)
    # plenty of room: the cause is something else, and the message does not blame the disk
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda _p: usage._replace(free=10**12))
    with pytest.raises(ckpt.CheckpointError) as e:
        w.submit(snap, blocking=True)
    assert "is full" not in str(e.value) and "unexpected pos" in str(e.value)


def test_model_dir_with_only_pickled_weights_is_refused(tiny_model_dir, tmp_path):
    import shutil

    from pitstop.train.model_io import check_model_dir

    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    check_model_dir(d, trust_remote_code=False)
    (d / "model.safetensors").unlink()
    torch.save({"w": torch.ones(1)}, d / "pytorch_model.bin")
    with pytest.raises(ConfigError, match=r"no \.safetensors weights"):
        check_model_dir(d, trust_remote_code=False)


@pytest.mark.parametrize("size", [0, 1000, 200_000])
def test_a_damaged_weights_file_in_model_is_named(tiny_model_dir, tmp_path, size):
    """model.safetensors cut short (a failed download or copy): one ConfigError naming
    --model and what to do, not safetensors' own exception."""
    import shutil
    from types import SimpleNamespace

    from pitstop import probe
    from pitstop.probe import DeviceInfo
    from pitstop.train import model_io

    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    with open(d / "model.safetensors", "r+b") as f:
        f.truncate(size)
    cfg = SimpleNamespace(model=str(d), trust_remote_code=False, lora_r=None,
                          load_in_4bit=False, gradient_checkpointing=False, attention="sdpa")  # fmt: skip
    dev = DeviceInfo("cpu", "test cpu", cpu_count=2)
    with pytest.raises(ConfigError, match=rf"--model {d}: a weights file is damaged") as e:
        model_io.load_model(cfg, dev, "fp32", probe.choose_attention("sdpa", dev, "fp32"))
    assert "download or save the model again" in e.value.render()


def test_custom_architecture_needs_trust_remote_code(tiny_model_dir, tmp_path):
    import shutil

    from pitstop.train.model_io import check_model_dir

    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="xcustom", auto_map={"AutoModelForCausalLM": "modeling_x.X"})
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="--trust-remote-code only if you trust"):
        check_model_dir(d, trust_remote_code=False)
    check_model_dir(d, trust_remote_code=True)  # trusted: transformers decides


def test_machine_problems_match_the_trainer_messages(tmp_path):
    from pitstop.core.config import RunConfig
    from pitstop.probe import output_dir_problem, preflight

    def cfg(**kw):
        return RunConfig(model="m", data=["d"], output=str(tmp_path / "out"), **kw)

    assert preflight(cfg(), CPU) == []
    [fp16] = preflight(cfg(precision="fp16"), CPU)
    with pytest.raises(ConfigError) as e:
        choose_precision("fp16", CPU)
    assert str(e.value) == fp16
    [bf16] = preflight(cfg(precision="bf16"), V100)
    assert "no bf16" in bf16
    probs = preflight(cfg(attention="flash_attention_2", lora_r=4, load_in_4bit=True), CPU)
    assert any("flash-attn needs a CUDA GPU" in p for p in probs)
    # bitsandbytes >= 0.45 (a dev dependency) runs 4-bit weights on the CPU
    assert not any("--load-in-4bit" in p for p in probs)
    # FSDP2 + LoRA runs (tests/test_distributed.py); 4-bit weights stay single-process.
    assert preflight(cfg(strategy="fsdp", lora_r=4, nproc=2), CPU) == []
    assert preflight(cfg(strategy="fsdp", lora_r=4, load_in_4bit=True, nproc=2), CPU) == [
        "--load-in-4bit is single-process only in pitstop; drop it or use --nproc 1"
    ]
    (tmp_path / "out" / "checkpoints").mkdir(parents=True)
    assert preflight(cfg(), CPU) == []  # the output directory is the train command's check
    held = output_dir_problem(str(tmp_path / "out"), resume=False, overwrite=False)
    assert held is not None and "already holds a run" in held
    assert output_dir_problem(str(tmp_path / "out"), resume=True, overwrite=False) is None


def test_measurement_config_turns_evaluation_off(tmp_path):
    from pitstop.core.config import RunConfig
    from pitstop.profiling import measurement_config

    cfg = RunConfig(model="m", data=["d"], eval_data="auto", eval_steps=5)
    run_cfg = measurement_config(cfg, tmp_path / "run", 4)
    assert run_cfg.eval_data is None and run_cfg.eval_steps is None


def test_inductor_caches_live_under_pitstops_cache_unless_the_user_set_theirs(
    tmp_path, monkeypatch
):
    from pitstop.train.compile_record import inductor_cache

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert inductor_cache(tmp_path) == str(tmp_path / "inductor")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/theirs")
    assert inductor_cache(tmp_path) == "/theirs"


def test_torchs_own_default_in_the_environment_is_not_taken_for_the_users(tmp_path) -> None:
    """Importing torch._dynamo writes torch's default cache dir into TORCHINDUCTOR_CACHE_DIR
    (transformers imports it while loading a model, before pitstop compiles): pitstop's
    cache still gets inductor's caches. Before the fix every compile wrote to
    /tmp/torchinductor_<user> and a fresh pitstop cache was never a cold compile."""
    code = (
        "import os, sys, torch._dynamo\n"
        "torch_set = os.environ.get('TORCHINDUCTOR_CACHE_DIR')\n"
        "from pitstop.train.compile_record import inductor_cache\n"
        "print(torch_set, inductor_cache(sys.argv[1]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env,
                         capture_output=True, text=True, check=True)  # fmt: skip
    torch_set, ours = out.stdout.split()
    assert torch_set != "None", "torch no longer writes its default: the case is gone"
    assert ours == str(tmp_path / "inductor")
