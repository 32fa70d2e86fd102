"""Checkpoint host memory (issue 26 item 7), on the CPU: tied weights copied once, pinned
buffers of their exact size (whole pages, never rounded to a power of two), FSDP waiting
for the previous write before gathering, FSDP2's mixed-precision policy under bf16."""

from __future__ import annotations

import pytest
import torch

from pitstop.train import checkpoint as ckpt
from pitstop.train import distributed as dist_mod


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(100, 16)
        self.head = torch.nn.Linear(16, 100, bias=False)
        self.head.weight = self.embed.weight  # tied, as most LMs' embedding and head


def test_tied_weights_from_state_dict_are_staged_and_counted_once() -> None:
    model = Tied()
    sd = model.state_dict()  # detaches: two tensor objects over one storage
    assert sd["embed.weight"] is not sd["head.weight"]
    st = ckpt.HostStaging()
    out, _ = st.stage(sd)
    assert st.allocations == 1 and out["embed.weight"] is out["head.weight"]
    assert st.nbytes == ckpt.state_bytes(sd) == 100 * 16 * 4
    host = ckpt.to_host(sd)
    assert host["embed.weight"] is host["head.weight"]


def test_views_of_one_storage_that_differ_are_not_merged() -> None:
    w = torch.arange(12.0)
    a, b = w[:6], w[6:]
    assert ckpt.tensor_key(a) != ckpt.tensor_key(b)
    assert ckpt.tensor_key(w.detach()) == ckpt.tensor_key(w)


def test_pinned_buffers_are_exact_whole_pages_not_powers_of_two() -> None:
    calls = []

    def register(ptr: int, nbytes: int) -> bool:
        calls.append((ptr, nbytes))
        return True

    shape = (5000, 1000)  # 20,000,000 bytes of fp32
    buf = ckpt.pinned_empty(shape, torch.float32, register=register)
    assert buf.shape == shape and buf.dtype == torch.float32
    ((ptr, nbytes),) = calls
    assert ptr % 4096 == 0
    assert nbytes == 20_000_768  # ceil to 4 KiB pages; the caching allocator took 33,554,432
    assert buf.data_ptr() == ptr
    # torch's is_pinned() looks up the storage's first byte: it must be the registered one
    assert buf.untyped_storage().data_ptr() == ptr
    buf.fill_(1.5)  # usable memory
    assert float(buf.sum()) == 1.5 * 5_000_000
    scalar = ckpt.pinned_empty((), torch.float32, register=register)
    assert scalar.shape == () and calls[-1][1] == 4096


def test_a_failed_pin_leaves_a_usable_pageable_buffer(caplog) -> None:
    def register(ptr: int, nbytes: int) -> bool:
        raise RuntimeError("cudaErrorHostMemoryAlreadyRegistered")

    monkey = ckpt._PIN_WARNED
    ckpt._PIN_WARNED = False
    try:
        buf = ckpt.pinned_empty((3, 4), torch.bfloat16, register=register)
    finally:
        ckpt._PIN_WARNED = monkey
    buf.copy_(torch.ones(3, 4))
    assert torch.equal(buf, torch.ones(3, 4, dtype=torch.bfloat16))
    assert "pinning checkpoint buffers failed" in caplog.text


def test_fsdp_checkpoint_waits_for_the_previous_write_before_gathering(monkeypatch) -> None:
    from pitstop.train.state import RunState
    from pitstop.train.trainer import Trainer

    order: list[str] = []

    class Writer:
        last_written = None

        def wait(self) -> None:
            order.append("wait")

        def submit(self, snap, blocking=False) -> None:
            order.append("submit")

    class Loader:
        def state_dict(self):
            return {}

    from types import SimpleNamespace

    from pitstop.train import run_dir

    run = SimpleNamespace(
        fsdp=True, scaler=None, model=object(), optimizer=object(), writer=Writer(),
        loader=Loader(), t_process=0.0,
    )  # fmt: skip
    t = Trainer.__new__(Trainer)
    t.run, t.is_main, t.state = run, True, RunState()
    t.cadence = SimpleNamespace(last_step=10)
    t.log = lambda: None
    monkeypatch.setattr(run_dir, "identity", lambda run, total_steps: {})
    monkeypatch.setattr(dist_mod, "full_state", lambda m: order.append("gather") or {})
    monkeypatch.setattr(dist_mod, "full_optimizer_state", lambda m, o: order.append("gather") or {})
    t.checkpoint(0.0)
    assert order == ["wait", "gather", "gather", "submit"]


def test_fsdp2_gets_a_bf16_mixed_precision_policy_under_bf16(monkeypatch) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from pitstop.core.config import RunConfig

    assert dist_mod.fsdp_mixed_precision("fp32") is None
    mp = dist_mod.fsdp_mixed_precision("bf16")
    assert isinstance(mp, MixedPrecisionPolicy)
    assert mp.param_dtype == torch.bfloat16 and mp.reduce_dtype == torch.float32
    seen = []
    import torch.distributed.fsdp as fsdp_pkg

    monkeypatch.setattr(fsdp_pkg, "fully_shard", lambda m, **kw: seen.append(kw.get("mp_policy")))

    class Block(torch.nn.Linear):
        pass

    model = torch.nn.Sequential(Block(4, 4), Block(4, 4))
    model._no_split_modules = ["Block"]
    cfg = RunConfig(model="m", data="d", output="o", strategy="fsdp")
    env = dist_mod.DistEnv(0, 2, 0, "gloo")
    _, choice = dist_mod.wrap(model, cfg, env, precision="bf16")
    assert len(seen) == 3 and all(p is not None and p.param_dtype == torch.bfloat16 for p in seen)
    assert "bf16 all-gather" in choice.reason
    seen.clear()
    dist_mod.wrap(model, cfg, env, precision="fp32")
    assert seen == [None, None, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_pinned_empty_dtypes(dtype) -> None:
    buf = ckpt.pinned_empty((7, 3), dtype, register=lambda p, n: True)
    assert buf.dtype == dtype and buf.shape == (7, 3) and buf.is_contiguous()
