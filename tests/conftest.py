"""Shared fixtures: a tiny Llama and its tokenizer, built once per test session, offline."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer, 64-wide Llama with a 4096-token BPE tokenizer trained on the bundled corpus."""
    from pitstop.tiny import build_model_dir

    return build_model_dir(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module (`pytestmark = pytest.mark.usefixtures("one_thread")`):
    tiny models gain nothing from threads, and on a busy CI box OpenMP's spinning threads
    make them many times slower; restored afterwards for the rest of the session."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture()
def cache_dir(tmp_path: Path) -> Path:
    d = tmp_path / "cache"
    d.mkdir()
    return d


@pytest.fixture(scope="module")
def store(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer
) -> Path:
    """A token store of the bundled corpus for a test module's training runs: 60 chapters,
    or the module's `STORE_DOCS` (fewer chapters: a shorter epoch for its runs)."""
    from _train_util import make_store

    n_docs = getattr(request.module, "STORE_DOCS", 60)
    return make_store(tmp_path_factory.mktemp("store") / "s", tiny_tokenizer, n_docs=n_docs)
