"""Helpers for the training tests: a small token store and configs (not a test module)."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path
from typing import Any

import numpy as np

from pitstop.core.config import RunConfig, build_config
from pitstop.core.corpus import sample_texts
from pitstop.data.store import StoreWriter


def make_store(dest: Path, tokenizer: Any, *, n_docs: int = 60, max_len: int = 64) -> Path:
    """A token store of the first `n_docs` corpus chapters split into <= max_len chunks."""
    if (dest / "manifest.json").is_file():
        return dest
    eos = tokenizer.eos_token_id
    toks, masks, lens, docs = [], [], [], []
    for d, text in enumerate(sample_texts(n_docs)):
        ids = tokenizer(text)["input_ids"] + [eos]
        for a in range(0, len(ids), max_len):
            chunk = ids[a : a + max_len]
            m = np.ones(len(chunk), np.uint8)
            if a == 0:
                m[0] = 0  # a document's first token is never a target
            toks.append(np.asarray(chunk))
            masks.append(m)
            lens.append(len(chunk))
            docs.append(d)
    w = StoreWriter(dest, vocab_size=len(tokenizer))
    w.append(np.concatenate(toks), np.concatenate(masks), lens, docs)
    w.finish({"max_seq_len": max_len, "eos_token_id": eos, "pad_token_id": tokenizer.pad_token_id})
    return dest


def train_config(model: Path, store: Path, out: Path, **over: Any) -> RunConfig:
    values = {
        "model": str(model),
        "data": [str(store)],
        "output": str(out),
        "max_seq_len": 64,
        "tokens_per_step": 256,
        "micro_batch_size": 2,
        "batching": "pack",
        "max_steps": 6,
        "log_steps": 2,
        "lr": 1e-3,
        "report_to": ["none"],
        "cache_dir": str(out.parent / "cache"),
        "compile": "off",
        # The tests' expected values are fp32 math; `precision: auto` may pick bf16 on a CPU
        # with native bf16 (tests/test_cpu_precision.py tests that choice on its own).
        "precision": "fp32",
    }
    values.update(over)
    return build_config(values, None)


REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A free TCP port on the loopback (torchrun's --master-port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(**extra: str) -> dict[str, str]:
    """The environment for a pitstop child process under torchrun: offline, one OpenMP
    thread per rank (two ranks on two cores), this checkout first on the path."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.update({"OMP_NUM_THREADS": "1", **extra})
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def assert_same_weights_across_ranks(ref: Path, out: Path) -> None:
    """Weights (safetensors files) trained by one process and by two ranks on the same
    tokens: the same math up to the ranks' summation order. AdamW divides by sqrt(v), so
    an element whose gradient is ~0 can turn that rounding into a visible difference (one
    element of 16k moved by 2.7e-5 in 6 steps at lr 1e-3, the rest by < 1.3e-6; on another
    CPU one v_proj element moved by 1.1e-4). Such an element's step can flip sign, so its
    bound is lr x steps, not rounding: every element within 1e-3, and at most 0.1% of each
    tensor beyond 1e-5 (a real difference in the math moves most of them)."""
    from safetensors.torch import load_file

    wa, wb = load_file(ref), load_file(out)
    assert sorted(wa) == sorted(wb)
    for k in wa:
        diff = (wa[k] - wb[k]).abs()
        assert float(diff.max()) < 1e-3, (k, float(diff.max()))
        assert int((diff > 1e-5).sum()) <= max(1, wa[k].numel() // 1000), k


def fake_hub_cache(root: Path, repo: str, model_dir: Path) -> Path:
    """huggingface_hub's cache layout: models--org--name/{refs/main, snapshots/REV/...}."""
    rev = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(rev)
    shutil.copytree(model_dir, repo_dir / "snapshots" / rev)
    return repo_dir / "snapshots" / rev


def stopped_run(
    model: Path, store: Path, out: Path, monkeypatch: Any, *, at_step: int = 2, **over: Any
) -> Any:
    """Run `pitstop.train.run` killed after step `at_step` (the fault variable), as a user's
    Ctrl-C or a lost machine would leave it: the run's choices.json, as read back."""
    import pytest

    import pitstop.train
    from pitstop.batching.choices import read_run_choices
    from pitstop.train.trainer import RunInterrupted

    monkeypatch.setenv("PITSTOP_TEST_STOP_AT_STEP", str(at_step))
    with pytest.raises(RunInterrupted):
        pitstop.train.run(train_config(model, store, out, **over))
    monkeypatch.delenv("PITSTOP_TEST_STOP_AT_STEP")
    return read_run_choices(out)
