"""Checkpoints copied into reused host buffers (issue 17): same files as a clone, no reuse
before the write is done, one allocation per tensor for the whole run.

The CUDA path (pinned buffers, a side stream and an event) is the same code with a stream;
its own tests are marked `gpu` at the end of this file.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pitstop.train import checkpoint as ckpt


def _save_model(dest: Path, state: dict[str, torch.Tensor]) -> None:
    # plain safetensors refuses shared tensors (save_pretrained drops tied copies itself)
    save_file({k: v for k, v in state.items() if k != "tied"}, dest / "model.safetensors")


def _state(value: float) -> tuple[dict[str, torch.Tensor], dict]:
    w = torch.full((4, 3), value)
    model = {"w": w, "tied": w, "b": torch.arange(3.0) + value}
    optim = {"state": {0: {"exp_avg": torch.full((4, 3), value / 2), "step": torch.tensor(value)}},
             "param_groups": [{"lr": 0.1, "params": [0]}]}  # fmt: skip
    return model, optim


def _snap(step: int, model: dict, optim: dict, ready=None) -> ckpt.Snapshot:
    return ckpt.Snapshot(step, model, {"optimizer": optim, "scaler": None}, {"step": step},
                         ckpt.rng_state(), {"pos": step}, ready=ready)  # fmt: skip


def test_staging_reuses_its_buffers_and_keeps_tied_tensors_tied():
    st = ckpt.HostStaging()
    model, optim = _state(1.0)
    (m1, _), ready = st.stage((model, optim))
    assert ready is None  # CPU: copied synchronously
    assert m1["w"] is m1["tied"]  # tied weights stay one tensor (written once)
    assert m1["w"] is not model["w"] and torch.equal(m1["w"], model["w"])
    ptrs = {k: v.data_ptr() for k, v in m1.items()}
    allocated = st.allocations
    assert allocated == 4  # w (tied: one buffer), b, exp_avg, step
    model["w"].fill_(7.0)  # training goes on mutating the source
    (m2, o2), _ = st.stage((model, optim))
    assert st.allocations == allocated  # nothing new: the same buffers
    assert {k: v.data_ptr() for k, v in m2.items()} == ptrs
    assert torch.equal(m2["w"], torch.full((4, 3), 7.0))
    assert o2["param_groups"] == optim["param_groups"]
    assert st.nbytes == ckpt.state_bytes((model, optim))


def test_staging_reallocates_a_buffer_whose_shape_or_dtype_changed():
    st = ckpt.HostStaging()
    st.stage({"a": torch.zeros(3)})
    out, _ = st.stage({"a": torch.ones(5, dtype=torch.float64)})
    assert out["a"].dtype == torch.float64 and torch.equal(
        out["a"], torch.ones(5, dtype=torch.float64)
    )
    assert st.allocations == 2


def test_checkpoint_through_buffers_is_identical_to_a_cloned_one(tmp_path):
    model, optim = _state(3.0)
    cloned = ckpt.CheckpointWriter(tmp_path / "a", keep=2, save_model=_save_model)
    cloned.submit(_snap(1, ckpt.to_host(model), ckpt.to_host(optim)), blocking=True)
    staged = ckpt.CheckpointWriter(tmp_path / "b", keep=2, save_model=_save_model)
    (m, o), ready = staged.stage((model, optim))
    staged.submit(_snap(1, m, o, ready), blocking=True)
    a, b = tmp_path / "a" / "step-1", tmp_path / "b" / "step-1"
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    ra, rb = ckpt.read_checkpoint(a), ckpt.read_checkpoint(b)
    sa, sb = ra.optimizer["optimizer"]["state"][0], rb.optimizer["optimizer"]["state"][0]
    assert all(torch.equal(sa[k], sb[k]) for k in ("exp_avg", "step"))
    assert ra.trainer_state == rb.trainer_state


def _slow_writer(
    root: Path, keep: int
) -> tuple[ckpt.CheckpointWriter, threading.Event, threading.Event]:
    """A writer whose model save sets `writing`, then waits for `release` (10 s at most)."""
    release = threading.Event()
    writing = threading.Event()

    def slow_save(dest: Path, state: dict[str, torch.Tensor]) -> None:
        writing.set()
        release.wait(10)
        _save_model(dest, state)

    return ckpt.CheckpointWriter(root, keep=keep, save_model=slow_save), writing, release


def test_a_second_checkpoint_waits_for_the_first_write_and_never_mixes_values(tmp_path):
    """The buffers are refilled only after the previous write has read them: a slow write of
    step 1 still holds step 1's values though step 2 is staged while it runs."""
    w, writing, release = _slow_writer(tmp_path / "c", keep=3)
    model, optim = _state(1.0)
    (m, o), ready = w.stage((model, optim))
    w.submit(_snap(1, m, o, ready))
    assert writing.wait(10)
    model["w"].fill_(2.0)  # the loop trains on while step 1 is written
    model["b"].fill_(2.0)
    staged: list[float] = []

    def stage_second() -> None:
        (m2, o2), r2 = w.stage((model, optim))
        staged.append(time.perf_counter())
        w.submit(_snap(2, m2, o2, r2))

    t = threading.Thread(target=stage_second)
    t.start()
    time.sleep(0.3)
    assert not staged  # stage() blocks: step 1 is still reading the buffers
    released_at = time.perf_counter()
    release.set()
    t.join(10)
    w.wait()
    assert staged and staged[0] >= released_at
    one = load_file(tmp_path / "c" / "step-1" / "model.safetensors")
    two = load_file(tmp_path / "c" / "step-2" / "model.safetensors")
    assert torch.equal(one["w"], torch.full((4, 3), 1.0)) and torch.equal(
        one["b"], torch.arange(3.0) + 1
    )
    assert torch.equal(two["w"], torch.full((4, 3), 2.0)) and torch.equal(
        two["b"], torch.full((3,), 2.0)
    )


def test_a_ctrl_c_inside_wait_leaves_the_write_waited_for(tmp_path):
    """A KeyboardInterrupt (a second Ctrl-C) raised while `wait()` blocks must not make the
    next `wait()` return before the write ends: with `Thread.join()` it did on Python < 3.13,
    the interpreter then exited under a thread inside `torch.save`, and the process aborted
    ("terminate called without an active exception", exit -6)."""
    w, writing, release = _slow_writer(tmp_path / "k", keep=2)
    model, optim = _state(1.0)
    w.submit(_snap(1, ckpt.to_host(model), ckpt.to_host(optim)))
    assert writing.wait(10)
    main = threading.main_thread().ident
    interrupt = threading.Timer(0.2, lambda: signal.pthread_kill(main, signal.SIGINT))
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        interrupt.start()  # SIGINT is handled in the main thread, inside w.wait()
        with pytest.raises(KeyboardInterrupt):
            w.wait()
    finally:
        interrupt.join()
        signal.signal(signal.SIGINT, old)
    assert w.busy() and w.last_written is None  # the write is still going
    threading.Timer(0.3, release.set).start()
    w.wait()  # must block until the write has ended
    assert not w.busy()
    assert w.last_written == tmp_path / "k" / "step-1"
    assert (w.last_written / "optimizer.pt").is_file()


def test_a_training_run_stages_once_and_its_checkpoints_hold_each_steps_weights(
    tiny_model_dir, store, tmp_path
):
    """Every step checkpointed: one set of buffers for the run, each checkpoint its own step's
    weights (the last equals final/), and the optimizer state kept at the end."""
    from _train_util import train_config

    from pitstop.train.build import build_run
    from pitstop.train.trainer import Trainer

    cfg = train_config(tiny_model_dir, store, tmp_path / "out", max_steps=3, save_steps=1,
                       save_total_limit=5)  # fmt: skip
    trainer = Trainer(build_run(cfg))
    summary = trainer.fit().to_json()
    st = trainer.run.writer.staging
    n_tensors = len(trainer.run.model.state_dict()) + sum(
        len(v) for v in trainer.run.optimizer.state_dict()["state"].values()
    )
    assert st.allocations <= n_tensors  # allocated once, not once per checkpoint
    assert summary["checkpoint_host_buffer_bytes"] == st.nbytes > 0
    root = tmp_path / "out" / "checkpoints"
    w = [load_file(root / f"step-{s}" / "model.safetensors") for s in (1, 2, 3)]
    final = load_file(tmp_path / "out" / "final" / "model.safetensors")
    name = next(k for k in w[2] if k.endswith("q_proj.weight"))
    assert not torch.equal(w[0][name], w[1][name]) and not torch.equal(w[1][name], w[2][name])
    assert torch.equal(w[2][name].to(final[name].dtype), final[name])
    opt = ckpt.read_checkpoint(root / "step-3").optimizer["optimizer"]
    assert opt["state"] and all("exp_avg" in s for s in opt["state"].values())
    assert "pinned" not in trainer.run.choices["checkpoints"].reason  # CPU: plain host memory
    assert "GB of host memory" in trainer.run.choices["checkpoints"].reason


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_tokenizer):
    from _train_util import make_store

    return make_store(tmp_path_factory.mktemp("staging") / "store", tiny_tokenizer)


# --- on a GPU -----------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
def test_cuda_staging_is_pinned_async_and_ordered_before_the_next_update():
    st = ckpt.HostStaging()
    w = torch.randn(2048, 2048, device="cuda")
    before = w.cpu()
    out, ready = st.stage({"w": w})
    assert ready is not None and out["w"].is_pinned()
    # The next optimizer step waits on the event on the device: the copy sees `before`.
    torch.cuda.current_stream().wait_event(ready)
    w.add_(1.0)
    ready.synchronize()
    assert torch.equal(out["w"], before)
    out2, ready2 = st.stage({"w": w})
    ready2.synchronize()
    assert out2["w"].data_ptr() == out["w"].data_ptr() and st.allocations == 1
    assert torch.equal(out2["w"], before + 1.0)


@pytest.mark.gpu
@needs_cuda
def test_cuda_run_checkpoints_match_the_model(tiny_model_dir, store, tmp_path):
    from _train_util import train_config

    from pitstop.train.build import build_run
    from pitstop.train.trainer import Trainer

    cfg = train_config(tiny_model_dir, store, tmp_path / "out", max_steps=3, save_steps=1,
                       save_total_limit=5, device="cuda", precision="bf16")  # fmt: skip
    trainer = Trainer(build_run(cfg))
    trainer.fit()
    root = tmp_path / "out" / "checkpoints"
    last = load_file(root / "step-3" / "model.safetensors")
    live = {k: v.detach().cpu() for k, v in trainer.run.model.state_dict().items()}
    assert all(torch.equal(last[k], live[k]) for k in last)
    assert "pinned host memory" in trainer.run.choices["checkpoints"].reason
