"""`pitstop.watch` on the shapes of real programs, in this process (issue 44): tokens from the
model's own forwards (no DataLoader), an optimizer step that runs a closure, evaluation as
a phase of its own, and an MFU that is never above 100%. The programs themselves, run as
their users run them, are tests/test_clients.py."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import pitstop
from pitstop.measure import peak
from pitstop.measure.forward_inputs import batch_counts, forward_counts
from pitstop.probe import DeviceInfo


class TinyGPT(torch.nn.Module):
    """nanoGPT's calling convention: `logits, loss = model(idx, targets)`."""

    def __init__(self, vocab: int = 50, width: int = 16) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        logits = self.head(self.tok(idx))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1
            )
        return logits, loss


def test_forward_counts_read_each_calling_convention() -> None:
    model = TinyGPT()
    x = torch.randint(0, 50, (4, 8))
    y = x.clone()
    y[:, :2] = -1  # nanoGPT's ignored positions
    c = forward_counts(model, (x, y), {})
    assert (c.rows, c.positions, int(c.seen), int(c.targets)) == (4, 32, 32, 4 * 6)
    # Hugging Face's `labels` are shifted inside the model: a row's first is never a target.
    hf = forward_counts(model, (), {"input_ids": x, "labels": x})
    assert int(hf.targets) == 4 * 7
    mask = torch.ones(4, 8, dtype=torch.long)
    mask[:, 6:] = 0  # right padding
    got = forward_counts(model, (), {"input_ids": x, "attention_mask": mask})
    assert int(got.seen) == 4 * 6 and int(got.targets) == 4 * 5
    # A batch handed whole (a LightningModule's forward(batch)): read inside the mapping.
    whole = forward_counts(torch.nn.Linear(2, 2), ({"input_ids": x, "labels": x},), {})
    assert whole is not None and int(whole.targets) == 4 * 7
    assert forward_counts(model, (torch.randn(4, 8),), {}) is None  # not token ids
    assert batch_counts((x, y)) is not None and batch_counts({"pixels": torch.randn(2)}) is None


def _loop(model: TinyGPT, opt: torch.optim.Optimizer, steps: int, evaluate_every: int) -> None:
    """nanoGPT's shape: batches cut by hand, an @no_grad loss estimate every few steps."""
    for it in range(steps):
        if evaluate_every and it and it % evaluate_every == 0:
            model.eval()
            with torch.no_grad():
                for _ in range(6):
                    model(torch.randint(0, 50, (4, 8)), torch.randint(0, 50, (4, 8)))
                    time.sleep(0.01)  # the loop's own work between evaluation batches
            model.train()
        for _ in range(2):  # accumulation
            x = torch.randint(0, 50, (4, 8))
            _, loss = model(x, torch.roll(x, -1, 1))
            loss.backward()
        opt.step()
        opt.zero_grad()


def test_tokens_without_a_dataloader_and_evaluation_as_its_own_phase(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pitstop.watch(output=tmp_path / "run", print_report=False, cache_dir=tmp_path) as w:
        _loop(model, opt, steps=9, evaluate_every=3)
    s = w.summary
    assert s.optimizer_steps == 9 and s.trained_tokens_per_step == 2 * 4 * 8
    assert s.config["per_device_train_batch_size"] == 4
    assert s.config["gradient_accumulation_steps"] == 2
    assert s.config["eval_steps"] == 3 and s.config["eval_strategy"] == "steps"
    prof = w.profile
    assert prof["events"]["evals"] == 2 and prof["events"]["eval_forwards"] == 12
    # The time between evaluation batches is the evaluation's: at least the loop's sleeps
    # between its forwards (5 of each evaluation's 6; the last is after its last forward).
    assert prof["phases"]["eval"] >= 2 * 5 * 0.01
    assert prof["program"] == "loop" and s.mfu is not None and 0 < s.mfu <= 1
    assert prof["model_shapes"]["vocab_size"] == 50 and prof["model_shapes"]["hidden_size"] == 16


def test_a_closure_step_charges_forward_and_backward_not_the_optimizer(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randint(0, 50, (4, 8))

    def closure() -> torch.Tensor:
        opt.zero_grad()
        _, loss = model(x, x)
        time.sleep(0.02)  # stands for a slow backward (inside the closure)
        loss.backward()
        return loss

    w = pitstop.watch(print_report=False, doctor=False, cache_dir=tmp_path).start()
    for _ in range(6):
        opt.step(closure)  # LBFGS / Lightning's automatic optimization
    s = w.stop()
    assert s.optimizer_steps == 6 and s.trained_tokens_per_step == 4 * 8
    phases = w.profile["phases"]
    assert phases["backward"] >= 5 * 0.02 and phases["forward"] > 0
    assert phases["optimizer"] < phases["backward"]  # the update alone


def test_a_peak_measured_busy_is_measured_again_and_mfu_never_above_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    busy = {"flops": 1e9, "other_cores": 1.8, "cores": 2, "busy": True}
    monkeypatch.setattr(peak, "measure_cpu_peak_quietly", lambda precision="fp32": dict(busy))
    flops, how = peak.cpu_peak(tmp_path)
    assert flops == 1e9 and "reads low" in how
    cached = json.loads(next(tmp_path.rglob("cpu_peak*.json")).read_text())
    assert cached["busy"] is True
    quiet = {"flops": 5e10, "other_cores": 0.0, "cores": 2, "busy": False}
    monkeypatch.setattr(peak, "measure_cpu_peak_quietly", lambda precision="fp32": dict(quiet))
    assert peak.cpu_peak(tmp_path)[0] == 5e10  # a busy entry is measured again, and replaced
    assert peak.cpu_peak(tmp_path)[0] == 5e10  # now quiet: reused
    cpu = DeviceInfo(type="cpu", name="cpu")
    # A run "faster than its peak": measured again; still faster, so no MFU and a note.
    got = peak.trusted_mfu(1e6, 1e6, cpu, "fp32", False, tmp_path)  # 1e12 FLOP/s > 5e10
    assert got["mfu"] is None and "MFU not reported" in (got["note"] or "")
    ok = peak.trusted_mfu(1e3, 1e6, cpu, "fp32", False, tmp_path)
    assert ok["mfu"] == pytest.approx(1e9 / 5e10) and ok["note"] is None
