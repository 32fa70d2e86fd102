"""Token ids meet the model's vocabulary before training, and a damaged store is refused.

Before: a model whose embedding is smaller than its tokenizer, or a store damaged into
out-of-range ids, failed mid-step with an IndexError traceback (a device-side assert on
CUDA); damage that kept the ids in range trained silently, as stores had no checksum.

"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from _train_util import make_store

from pitstop.core.errors import DataError
from pitstop.data.store import TokenStore, check_vocab


@pytest.fixture()
def store(tmp_path, tiny_tokenizer) -> Path:
    return make_store(tmp_path / "s", tiny_tokenizer, n_docs=8)


def test_manifest_records_largest_id_and_checksums(store):
    m = json.loads((store / "manifest.json").read_text())
    tokens = np.fromfile(store / "tokens.bin", dtype=m["dtype"])
    assert m["max_token_id"] == int(tokens.max())
    arrays = {"tokens.bin", "mask.bin", "offsets.bin", "doc_ids.bin"}
    assert set(m["checksums"]) == arrays | {"seq_lengths.bin", "seq_trained.bin"}
    assert TokenStore(store).max_token_id == int(tokens.max())


@pytest.mark.parametrize("name", ["tokens.bin", "mask.bin", "offsets.bin", "doc_ids.bin"])
def test_in_range_damage_is_refused_by_name(store, name):
    TokenStore(store)  # verified once and remembered for this process
    p = store / name
    raw = bytearray(p.read_bytes())
    i = len(raw) // 2
    raw[i], raw[i + 1] = raw[i + 1], raw[i]  # a swap: same size, same values, other order
    if raw == p.read_bytes():
        raw[i] ^= 1
    p.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=rf"{name} does not match the checksum in its manifest"):
        TokenStore(store)


@pytest.mark.parametrize("cut", [None, 3])
def test_a_missing_or_cut_file_is_refused_by_name(store, cut):
    """A file gone ("mask.bin has None bytes" before) or cut short: said in words."""
    p = store / "mask.bin"
    size = p.stat().st_size
    if cut is None:
        p.unlink()
    else:
        os.truncate(p, cut)
    has = "is missing" if cut is None else f"has {cut} bytes"
    with pytest.raises(DataError, match=rf"mask\.bin {has}, the manifest says {size:,} bytes"):
        TokenStore(store)


def test_old_store_without_the_new_fields_opens_and_is_scanned(store):
    m = json.loads((store / "manifest.json").read_text())
    true_max = m.pop("max_token_id")
    m.pop("checksums")
    (store / "manifest.json").write_text(json.dumps(m))
    s = TokenStore(store)
    assert s.max_token_id == true_max  # found by one scan of tokens.bin


def _model_with_rows(src: Path, dest: Path, rows: int) -> Path:
    from transformers import AutoModelForCausalLM

    shutil.copytree(src, dest)
    model = AutoModelForCausalLM.from_pretrained(src)
    model.resize_token_embeddings(rows)
    model.save_pretrained(dest)
    return dest


def test_store_ids_past_the_embedding_are_refused(store, tiny_model_dir, tmp_path):
    s = TokenStore(store)
    check_vocab(s, tiny_model_dir)  # the tiny model's own tokenizer fits
    small = tmp_path / "small"
    small.mkdir()
    (small / "config.json").write_text(json.dumps({"vocab_size": s.max_token_id}))
    with pytest.raises(DataError, match=rf"holds token id {s.max_token_id}, but the model"):
        check_vocab(s, small)


def test_tokenizer_larger_than_embedding_is_refused(store, tmp_path):
    m = json.loads((store / "manifest.json").read_text())
    m["tokenizer"] = {"path": "tok", "vocab_size": m["max_token_id"] + 2}  # as prepare records it
    (store / "manifest.json").write_text(json.dumps(m))
    s = TokenStore(store)
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"text_config": {"vocab_size": s.max_token_id + 1}}))
    with pytest.raises(DataError, match=r"the tokenizer that prepared .* has \d+ tokens, more"):
        check_vocab(s, d)


@pytest.mark.slow
def test_train_refuses_a_model_with_a_smaller_embedding(tiny_model_dir, tmp_path, capsys):
    """Through `pitstop train`: a clean error before the first step, not an IndexError."""
    from _rel import train_cmd

    from pitstop.cli import main

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"chapter {i} of the long story"}) + "\n"
                            for i in range(40)))  # fmt: skip
    small = _model_with_rows(tiny_model_dir, tmp_path / "small", 64)
    out = tmp_path / "out"
    rc = main(train_cmd(small, data, out, steps=2)[3:])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "has an embedding of 64 rows" in err and "more than the model's 64 embedding rows" in err
    assert "resize_token_embeddings" in err and "Traceback" not in err
    assert not (out / "final").exists()


def test_recheck_data_sees_an_edit_that_kept_size_and_mtime(tiny_model_dir, tmp_path, capsys):
    """The documented limit of the fingerprint memo, and the flag that lifts it."""
    from pitstop.cli import main

    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "alpha beta gamma"}\n' * 20)
    st = f.stat()
    args = ["prepare", "--model", str(tiny_model_dir), "--data", str(f),
            "--cache-dir", str(tmp_path / "c"), "--workers", "1", "--json"]  # fmt: skip

    def prepare(*extra: str) -> dict:
        assert main([*args, *extra]) == 0
        return json.loads(capsys.readouterr().out)

    first = prepare()
    f.write_text('{"text": "delta beta gamma"}\n' * 20)  # same size
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert prepare()["store"] == first["store"]  # served from the cache: the stated limit
    rechecked = prepare("--recheck-data")
    assert rechecked["store"] != first["store"] and rechecked["cache_hit"] is False
