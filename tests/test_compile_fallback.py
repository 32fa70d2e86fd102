"""`--compile on` falls back to the wrapped module, agrees across ranks, and leaves an
out-of-memory to the OOM path (pitstop/train/compile.py), on the CPU with fakes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from _train_util import assert_same_weights_across_ranks, rank_env

from pitstop.train.compile import GuardedForward


class Wrapper:
    """Stands for the DDP wrapper: what the fallback must call (never the bare module)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, **kw):
        self.calls += 1
        return "eager"


def test_compile_failure_falls_back_to_the_wrapped_module(caplog) -> None:
    wrapper = Wrapper()

    def broken(**kw):
        raise RuntimeError("inductor: unsupported op aten::foo")

    g = GuardedForward(wrapper, broken)
    assert g.active and not g.failed
    assert g(x=1) == "eager"
    assert wrapper.calls == 1 and not g.active and g.failed
    assert "aten::foo" in g.failure
    assert g(x=1) == "eager" and wrapper.calls == 2  # for good, without retrying compile


def test_compile_off_calls_the_wrapped_module() -> None:
    wrapper = Wrapper()
    g = GuardedForward(wrapper, None)
    assert g() == "eager" and not g.failed


@pytest.mark.parametrize("wrapped_in", [None, RuntimeError])
def test_an_oom_while_compiling_is_an_oom_not_a_compile_failure(wrapped_in) -> None:
    wrapper = Wrapper()

    def oom(**kw):
        err = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if wrapped_in is None:
            raise err
        raise wrapped_in("backend compiler failed") from err  # how dynamo wraps it

    g = GuardedForward(wrapper, oom)
    with pytest.raises(RuntimeError) as e:
        g()
    from pitstop.train import oom as oom_mod

    assert oom_mod.is_oom(e.value)
    assert g.active and not g.failed and wrapper.calls == 0  # compile stays on, no eager retry


def test_the_failed_attempt_is_released_before_the_eager_retry() -> None:
    """The eager call runs outside the `except`: the failed attempt's frames are gone."""
    import gc
    import weakref

    holder: list = []

    def broken(**kw):
        big = torch.ones(1000)
        holder.append(weakref.ref(big))
        raise RuntimeError("compile failed")

    seen = []

    def eager(**kw):
        gc.collect()
        seen.append(holder[0]() is None)
        return 1

    GuardedForward(eager, broken)()
    assert seen == [True]


# The shared `store` fixture (tests/conftest.py) builds a 12-chapter store here.
STORE_DOCS = 12


@pytest.mark.slow
def test_an_oom_in_compile_backs_off_and_keeps_compile(
    tiny_model_dir, store, tmp_path, monkeypatch
):
    """One process: a CUDA OOM raised by the compiled forward on 2-row micro-batches goes
    to the OOM back-off (1 row), and the run finishes compiled."""
    from _train_util import train_config

    from pitstop.train import compile as compile_mod
    from pitstop.train.trainer import Trainer

    def fake_compile(wrapped, model, rank, faults=None, *, dynamic_width=False):
        def forward(**kw):
            if kw["input_ids"].shape[0] > 1:
                raise RuntimeError("backend failed") from torch.OutOfMemoryError(
                    "CUDA out of memory"
                )
            return wrapped(**kw)

        return forward

    monkeypatch.setattr(compile_mod, "compile_module", fake_compile)
    monkeypatch.setattr("pitstop.train.build.compile_module", fake_compile)
    # The back-off applies to CUDA OOMs only; the fake's is one (torch.OutOfMemoryError).
    cfg = train_config(tiny_model_dir, store, tmp_path / "out", compile="on", max_steps=2)
    s = Trainer.from_config(cfg).fit().to_json()
    assert s["choices"]["compile"]["value"] is True
    assert "backed off" in s["choices"]["micro_batch"]["reason"]


@pytest.mark.slow
@pytest.mark.long
def test_ddp_compile_failure_on_one_rank_all_ranks_go_eager_wrapped(
    tiny_model_dir, store, tmp_path
) -> None:
    """Two gloo ranks, rank 1's compile fails: the run trains to the one-process result
    (gradients still all-reduced: the fallback kept the DDP wrapper) and every rank ends eager."""
    from _train_util import train_config

    from pitstop.train import run

    ref = tmp_path / "ref"
    run(train_config(tiny_model_dir, store, ref, max_steps=4, micro_batch_size=2))
    out = tmp_path / "ddp"
    args = ["train", "--model", str(tiny_model_dir), "--data", str(store), "--output", str(out),
            "--max-seq-len", "64", "--tokens-per-step", "256", "--micro-batch-size", "1",
            "--batching", "pack", "--max-steps", "4", "--log-steps", "2", "--lr", "1e-3",
            "--report-to", "none", "--compile", "on", "--nproc", "2",
            "--cache-dir", str(tmp_path / "cache")]  # fmt: skip
    r = subprocess.run([sys.executable, "-m", "pitstop", *args], capture_output=True, text=True,
                       env=rank_env(PITSTOP_TEST_COMPILE_FAILS_ON_RANK="1"), timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["choices"]["compile"]["value"] is False  # rank 0 went eager too
    assert "compile failed" in s["choices"]["compile"]["reason"]
    # The same math up to the ranks' summation order.
    assert_same_weights_across_ranks(
        ref / "final" / "model.safetensors", out / "final" / "model.safetensors"
    )
