"""GPU-only optimisations that fail fall back to the plain path with a warning naming what
failed (issue 26, "fail safe on the GPU"); CPU tests with fakes. Compile: test_compile_fallback.py;
pinned staging: test_checkpoint_host_memory.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_tokenizer):
    from _train_util import make_store

    return make_store(tmp_path_factory.mktemp("failsafe") / "store", tiny_tokenizer, n_docs=40)


def test_a_failing_sizer_leaves_the_default_split(tiny_model_dir, store, tmp_path, caplog) -> None:
    from _train_util import train_config

    from pitstop.batching.resolve import BatchRequest, MicroSizer
    from pitstop.data.store import TokenStore
    from pitstop.train import data as data_mod

    def measure(batch):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    cfg = train_config(tiny_model_dir, store, tmp_path / "out", micro_batch_size=None,
                       tokens_per_step=16 * 64)  # fmt: skip
    req = BatchRequest(
        cfg, TokenStore(cfg.data[0]), device_name="FakeGpu 80GB", out=Path(cfg.output),
        cache_dir=cfg.cache_dir,
    )  # fmt: skip
    default, _ = data_mod.build_loader(req)
    sizer = MicroSizer(measure, 80e9, 0.0)
    loader, geo = data_mod.build_loader(dataclasses.replace(req, sizer=sizer))
    micro = geo.choices["micro_batch"]
    assert micro.value == "default" and "illegal memory access" in micro.reason
    assert "sizing to the device failed" in caplog.text
    assert loader.settings == default.settings


def test_a_kernel_that_fails_its_first_forward_falls_back_to_sdpa(caplog) -> None:
    """flex_attention (or any kernel) raising in the start-up check's forward: the run goes
    on with sdpa, checked the same way, and the banner says why."""
    from _attention_util import tiny_llama

    from pitstop.train.attention_check import packed_attention_check

    model = tiny_llama("sdpa")
    real = model.forward

    def forward(*a, **kw):
        if model.config._attn_implementation == "flex_attention":
            raise RuntimeError("flex_attention: triton compile failed")
        return real(*a, **kw)

    model.forward = forward
    model.config._attn_implementation = "flex_attention"
    check, attention = packed_attention_check(
        model, torch.device("cpu"), "flex_attention", None, "fp32"
    )
    assert attention.value == "sdpa" and "triton compile failed" in attention.reason
    assert check.ok and check.attention == "sdpa"
    assert model.config._attn_implementation == "sdpa"
    assert "flex_attention failed" in caplog.text
