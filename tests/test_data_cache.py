"""The content-addressed cache: hits, misses on any change, and atomic writes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pitstop.core.config import RunConfig
from pitstop.data import prepare as prep
from pitstop.data.prepare import prepare_data
from pitstop.data.store import StoreWriter, TokenStore, is_store


def cfg(model: Path, cache: Path, data: list, **kw) -> RunConfig:
    return RunConfig(
        data=[str(d) for d in data],
        model=str(model),
        cache_dir=str(cache),
        workers=kw.pop("workers", 1),
        **kw,
    )


def write(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def valid_stores(cache: Path) -> list[Path]:
    d = cache / "stores"
    return [p for p in d.iterdir() if is_store(p)] if d.is_dir() else []


def test_second_prepare_is_a_hit(tmp_path, tiny_model_dir, cache_dir):
    f = write(tmp_path / "a.jsonl", ["one", "two"])
    a = prepare_data(cfg(tiny_model_dir, cache_dir, [f]), progress=False)
    b = prepare_data(cfg(tiny_model_dir, cache_dir, [f], workers=2), progress=False)
    assert not a.cache_hit and b.cache_hit  # worker count does not change the tokens
    assert a.store_path == b.store_path and a.stats == b.stats
    # A store given as --data is used as is.
    c = prepare_data(cfg(tiny_model_dir, cache_dir, [a.store_path]), progress=False)
    assert c.cache_hit and c.store_path == a.store_path and c.stats == a.stats


def test_env_cache_dir(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("PITSTOP_CACHE_DIR", str(tmp_path / "envcache"))
    f = write(tmp_path / "a.jsonl", ["one"])
    p = prepare_data(RunConfig(data=[str(f)], model=str(tiny_model_dir), workers=1), progress=False)
    assert p.store_path.parent == tmp_path / "envcache" / "stores"


def test_miss_on_changed_data_tokenizer_or_option(tmp_path, tiny_model_dir, cache_dir):
    f = write(tmp_path / "a.jsonl", ["one", "two"])
    base = prepare_data(cfg(tiny_model_dir, cache_dir, [f]), progress=False)
    seen = {base.store_path}

    for opt in (
        {"max_seq_len": 512},
        {"long_docs": "drop"},
        {"train_on_prompt": True},
        {"on_bad_record": "skip"},
        {"text_field": "body"},
        {"template": "{instruction}"},
    ):
        c = cfg(tiny_model_dir, cache_dir, [f], **opt)
        if "text_field" in opt:
            g = tmp_path / "b.jsonl"
            g.write_text('{"body": "one"}\n{"body": "two"}\n')
            c.data = [str(g)]
        p = prepare_data(c, progress=False)
        assert not p.cache_hit and p.store_path not in seen, opt
        seen.add(p.store_path)

    time.sleep(0.01)
    write(f, ["one", "three"])  # same size, new content and mtime
    p = prepare_data(cfg(tiny_model_dir, cache_dir, [f]), progress=False)
    assert not p.cache_hit and p.store_path not in seen
    seen.add(p.store_path)

    tok2 = tmp_path / "tok2"
    shutil.copytree(tiny_model_dir, tok2)
    tc = json.loads((tok2 / "tokenizer_config.json").read_text())
    tc["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tok2 / "tokenizer_config.json").write_text(json.dumps(tc))
    for extra in tok2.glob("chat_template.*"):
        extra.unlink()
    p = prepare_data(cfg(tiny_model_dir, cache_dir, [f], tokenizer=str(tok2)), progress=False)
    assert not p.cache_hit and p.store_path not in seen


def test_exception_mid_write_leaves_nothing(tmp_path, tiny_model_dir, cache_dir, monkeypatch):
    from pitstop.core.corpus import sample_texts

    f = write(tmp_path / "a.jsonl", sample_texts(100))
    monkeypatch.setattr(prep, "CHUNK_BYTES", 10_000)
    calls = {"n": 0}
    real = StoreWriter.append

    def failing(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # what Ctrl-C does mid-write
        return real(self, *a, **k)

    monkeypatch.setattr(StoreWriter, "append", failing)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(cfg(tiny_model_dir, cache_dir, [f], workers=2), progress=False)
    assert list((cache_dir / "stores").iterdir()) == []  # partial directory removed
    monkeypatch.setattr(StoreWriter, "append", real)
    p = prepare_data(cfg(tiny_model_dir, cache_dir, [f]), progress=False)
    assert not p.cache_hit and TokenStore(p.store_path).manifest["stats"]["documents"] == 100


_CHILD = """
import sys
from pitstop.core.config import RunConfig
from pitstop.data.prepare import prepare_data
prepare_data(RunConfig(data=[sys.argv[1]], model=sys.argv[2], cache_dir=sys.argv[3], workers=1), progress=False)
"""


@pytest.mark.slow
def test_sigkill_mid_prepare_leaves_no_valid_store(tmp_path, tiny_model_dir, cache_dir):
    from pitstop.core.corpus import sample_texts

    texts = sample_texts(400)
    f = write(tmp_path / "big.jsonl", texts * 2)  # ~3 MB: a few seconds of work on one core
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(f), str(tiny_model_dir), str(cache_dir)],
        env={**os.environ, "PYTHONPATH": str(Path(prep.__file__).parents[2])},
    )
    stores = cache_dir / "stores"
    deadline = time.time() + 60
    try:
        while time.time() < deadline:
            partial = list(stores.glob("*.partial-*")) if stores.is_dir() else []
            if (
                partial
                and (partial[0] / "tokens.bin").is_file()
                and (partial[0] / "tokens.bin").stat().st_size
            ):
                break
            assert proc.poll() is None, "the prepare finished before it could be killed"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert valid_stores(cache_dir) == []
    assert all(".partial-" in p.name for p in stores.iterdir())
    p = prepare_data(cfg(tiny_model_dir, cache_dir, [f], workers=2), progress=False)
    assert not p.cache_hit and p.stats["documents"] == len(texts) * 2
    assert valid_stores(cache_dir) == [p.store_path]
