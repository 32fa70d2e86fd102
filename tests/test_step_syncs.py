"""No hidden host reads of tensors in the training step (issue 26: per-step host syncs).

On a GPU, reading a device tensor on the host (`.item()`, `bool(t)`, `float(t)`, `int(t)`,
`.tolist()`) waits for the device. The design allows them only at logging steps and
checkpoints. On the CPU nothing waits, but the reads are the same code: every such read
made by pitstop's own code during a non-logging step is recorded here, and only the
documented one may appear (optimizer_step's skip flag, taken only where the optimizer
has no device-side skip: the CPU and bitsandbytes' 8-bit optimizers).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

PITSTOP = str(Path(__file__).resolve().parents[1] / "pitstop")
ALLOWED = {
    ("trainer.py", "optimizer_step"),
    # sdpa_docs reads its document offsets, which to_device keeps on the host for it even
    # on a GPU (train/attention.py; test_sdpa_docs_offsets_stay_on_the_host): no device sync.
    ("doc_kernel.py", "doc_spans"),
}
# The loader builds host batches (counts, metadata) before to_device moves them: reading
# those is host work, never a device sync.
HOST_ONLY = str(Path(PITSTOP) / "batching")
READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")


# The shared `store` fixture (tests/conftest.py) builds a 12-chapter store here.
STORE_DOCS = 12


def test_only_the_documented_host_reads_happen_in_a_step(
    tiny_model_dir, store, tmp_path, monkeypatch
) -> None:
    from _train_util import train_config

    from pitstop.train.trainer import Trainer

    seen: set[tuple[str, str]] = set()
    counting = [False]

    def spy(name):
        orig = getattr(torch.Tensor, name)

        def read(self, *a, **k):
            if counting[0]:
                f = sys._getframe(1)
                name = f.f_code.co_filename
                if name.startswith(PITSTOP) and not name.startswith(HOST_ONLY):
                    seen.add((Path(name).name, f.f_code.co_name))
            return orig(self, *a, **k)

        return read

    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, spy(name))
    real_step = Trainer._train_step

    def step(self, tl):
        counting[0] = True
        try:
            return real_step(self, tl)
        finally:
            counting[0] = False

    monkeypatch.setattr(Trainer, "_train_step", step)
    cfg = train_config(tiny_model_dir, store, tmp_path / "out", max_steps=3, log_steps=100)
    Trainer.from_config(cfg).fit()
    assert seen <= ALLOWED, f"host reads of tensors in the step path: {sorted(seen - ALLOWED)}"
    assert seen  # the spy works: the CPU's skip flag read was seen


def test_sdpa_docs_offsets_stay_on_the_host() -> None:
    """What makes per_document_sdpa's read host work: its offsets never go to the device."""
    from pitstop.train.attention import attention_kwargs

    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]])
    kw = attention_kwargs({"position_ids": position_ids}, "sdpa_docs", torch.device("cuda"))
    assert kw["cu_seq_lens_q"].device.type == "cpu"
    assert kw["cu_seq_lens_q"].tolist() == [0, 3, 5, 6, 10, 12]


def _masking_work(attention: str, monkeypatch) -> tuple[set[str], int]:
    """(host reads of tensors made by transformers' mask code, calls of its packed-row
    detection) in one training forward."""
    import transformers.masking_utils as mu
    from _attention_util import tiny_llama

    from pitstop.train.doc_attention import register
    from pitstop.train.forward import forward_kwargs, to_device

    register()
    model = tiny_llama(attention)
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]])
    ids = torch.randint(1, 100, (2, 6))
    mb = {"input_ids": ids, "labels": ids.clone(), "position_ids": pos}
    seen: set[str] = set()
    detections = [0]
    for name in READS:
        orig = getattr(torch.Tensor, name)

        def read(self, *a, _orig=orig, **k):
            f = sys._getframe(1)
            if "masking_utils" in f.f_code.co_filename:
                seen.add(f.f_code.co_name)
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, read)
    detect = mu.find_packed_sequence_indices

    def counted(*a, **k):
        detections[0] += 1
        return detect(*a, **k)

    monkeypatch.setattr(mu, "find_packed_sequence_indices", counted)
    with torch.no_grad():
        model(**forward_kwargs(to_device(mb, torch.device("cpu"), attention)))
    monkeypatch.undo()
    return seen, detections[0]


def test_sdpa_docs_forward_skips_transformers_packed_row_detection(monkeypatch) -> None:
    """transformers' packed-row detection builds a mask sdpa_docs never uses, and (in
    transformers 5.24 here, not 4.56) reads its answer on the host: a device sync per forward
    on a GPU.
    sdpa_docs' marker mask skips it; sdpa, which needs that mask, runs it (the spy works)."""
    assert _masking_work("sdpa_docs", monkeypatch) == (set(), 0)
    assert _masking_work("sdpa", monkeypatch)[1] > 0
