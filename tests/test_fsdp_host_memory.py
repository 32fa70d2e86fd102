"""FSDP host memory at the end of a run and on --resume.

The end: final/ reuses the weights the last step's checkpoint gathered, so rank 0 never
gathers a second full copy while the writer thread still holds the first. Resume: only
rank 0 reads the full checkpoint; FSDP2 broadcasts it tensor by tensor (2 processes,
gloo), and the resumed run continues bit-identically.
"""

from __future__ import annotations

import json
import subprocess
import sys
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _train_util import free_port, rank_env
from safetensors.torch import load_file

from pitstop.train import distributed as dist_mod

REPO = Path(__file__).resolve().parents[1]


class _Writer:
    """A checkpoint writer whose write lasts until `wait()`: it holds the snapshot so long."""

    last_written = None

    def __init__(self) -> None:
        self.writing = None

    def wait(self) -> None:
        self.writing = None

    def submit(self, snap, blocking: bool = False) -> None:
        self.wait()
        self.writing = snap


def _trainer(monkeypatch, *, step: int, last_ckpt_step: int | None):
    """A Trainer at the end of an FSDP run on rank 0, with gathers and final/ recorded."""
    from pitstop.train import run_dir, trainer
    from pitstop.train.state import RunState

    seen = SimpleNamespace(gathers=[], live_at_gather=[], final=[])
    alive: list[weakref.ref] = []

    def full_state(model):
        seen.live_at_gather.append(sum(r() is not None for r in alive))
        seen.gathers.append("model")
        w = torch.zeros(4)
        alive.append(weakref.ref(w))
        return {"w": w}

    def full_optimizer_state(model, optimizer):
        seen.gathers.append("optimizer")
        return {}

    monkeypatch.setattr(dist_mod, "full_state", full_state)
    monkeypatch.setattr(dist_mod, "full_optimizer_state", full_optimizer_state)
    monkeypatch.setattr(run_dir, "identity", lambda run, total_steps: {})
    monkeypatch.setattr(
        trainer, "write_final", lambda model, tok, out, state, cfg, **kw: seen.final.append(state)
    )
    run = SimpleNamespace(
        fsdp=True, scaler=None, model=object(), optimizer=object(), writer=_Writer(),
        loader=SimpleNamespace(state_dict=dict), t_process=0.0, tokenizer=None, out=None,
        cfg=None,
    )  # fmt: skip
    t = trainer.Trainer.__new__(trainer.Trainer)
    t.run, t.is_main, t.save_final = run, True, True
    t.state = RunState(step=step)
    t.cadence = SimpleNamespace(last_step=step)
    t.log = lambda: None
    t._last_ckpt_step, t._final_state = last_ckpt_step, None
    return t, seen


def test_final_save_reuses_the_last_checkpoints_gather(monkeypatch) -> None:
    t, seen = _trainer(monkeypatch, step=4, last_ckpt_step=2)
    t._final_save(0.0)  # the last checkpoint is taken here, then final/
    assert seen.gathers == ["model", "optimizer"]  # one gather, not a second for final/
    assert seen.final[0]["w"] is t.run.writer.writing.model_state["w"]  # the same tensors
    assert seen.final[0] is not t.run.writer.writing.model_state  # its own dict (tied keys)
    assert t._final_state is None  # not kept past the end


def test_a_checkpoint_at_the_last_step_in_the_loop_serves_final_too(monkeypatch) -> None:
    t, seen = _trainer(monkeypatch, step=4, last_ckpt_step=None)
    t.checkpoint(0.0)  # the loop's save at the last step (`due.save`)
    t._last_ckpt_step = 4
    t._final_save(0.0)
    assert seen.gathers == ["model", "optimizer"]


def test_final_save_without_a_kept_gather_waits_for_the_writer_first(monkeypatch) -> None:
    t, seen = _trainer(monkeypatch, step=4, last_ckpt_step=None)
    t.state.step = 2  # a checkpoint before the last step is not kept for final/
    t.checkpoint(0.0)
    assert t._final_state is None
    assert t.run.writer.writing is not None  # step 2's write is still going on
    t.state.step = 4
    t._last_ckpt_step = 4  # as after resuming from the last step's checkpoint
    t._final_save(0.0)
    assert seen.gathers == ["model", "optimizer", "model"]
    # Step 2's gathered copy was written and let go before final/'s was gathered.
    assert seen.live_at_gather == [0, 0]


@pytest.mark.slow
@pytest.mark.long
def test_fsdp2_load_full_state_reads_on_rank_0_only_and_resumes_exactly(tmp_path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), str(REPO / "tests" / "_grad_accum_worker.py"),
           "resume", str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, env=rank_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1))
    assert r0["reads"] == [0] and r1["reads"] == []  # only rank 0 read the checkpoint
    assert r0["held_full_state"] and not r1["held_full_state"]
    assert r0["bit_identical"] and r1["bit_identical"]


# The shared `store` fixture (tests/conftest.py) builds a 12-chapter store here.
STORE_DOCS = 12


@pytest.mark.slow
@pytest.mark.long
def test_fsdp2_full_fine_tune_resumes_bit_identically(tiny_model_dir, store, tmp_path) -> None:
    """Stopped after step 2 and resumed (rank 0 reads, FSDP2 broadcasts) == uninterrupted."""

    def torchrun(out: Path, *extra: str, **env: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(free_port()), "-m", "pitstop", "train",
               "--model", str(tiny_model_dir), "--data", str(store), "--output", str(out),
               "--max-seq-len", "64", "--tokens-per-step", "256", "--micro-batch-size", "1",
               "--batching", "pack", "--max-steps", "4", "--log-steps", "2", "--lr", "1e-3",
               "--report-to", "none", "--compile", "off", "--save-steps", "2",
               "--cache-dir", str(tmp_path / "cache"), "--strategy", "fsdp", *extra]  # fmt: skip
        return subprocess.run(cmd, env=rank_env(**env), capture_output=True, text=True, timeout=240)

    whole, cut = tmp_path / "whole", tmp_path / "cut"
    done = torchrun(whole)
    assert done.returncode == 0, done.stderr[-3000:]
    stopped = torchrun(cut, PITSTOP_TEST_STOP_AT_STEP="2")
    assert stopped.returncode != 0 and (cut / "checkpoints" / "step-2" / "COMPLETE.json").is_file()
    saved = (cut / "checkpoints" / "step-2" / "optimizer.pt").read_bytes()
    resumed = torchrun(cut, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((cut / "summary.json").read_text())["resumed_from"].endswith("step-2")
    # optimizer.pt was memory-mapped (privately): training on did not write into it.
    assert (cut / "checkpoints" / "step-2" / "optimizer.pt").read_bytes() == saved
    for name in ("final/model.safetensors", "checkpoints/step-4/model.safetensors"):
        a, b = load_file(whole / name), load_file(cut / name)
        assert sorted(a) == sorted(b)
        assert all(torch.equal(a[k], b[k]) for k in a), name
    opt_a = torch.load(whole / "checkpoints/step-4/optimizer.pt", weights_only=True)
    opt_b = torch.load(cut / "checkpoints/step-4/optimizer.pt", weights_only=True)
    for name, st in opt_a["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(v, opt_b["optimizer"]["state"][name][k]), (name, k)
    loss = [json.loads(x)["loss"] for x in (whole / "metrics.jsonl").read_text().splitlines()]
    again = [json.loads(x)["loss"] for x in (cut / "metrics.jsonl").read_text().splitlines()]
    assert loss == again
