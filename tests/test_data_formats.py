"""Every input format reads to the same documents; valid oddities just work."""

from __future__ import annotations

import csv
import gzip
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

from pitstop.core.config import RunConfig
from pitstop.data.prepare import open_store, prepare_data
from pitstop.data.store import TokenStore

TEXTS = [
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form.",
]


def cfg(model: Path, cache: Path, data: list, **kw) -> RunConfig:
    return RunConfig(
        data=[str(d) for d in data],
        model=str(model),
        cache_dir=str(cache),
        workers=kw.pop("workers", 1),
        **kw,
    )


def docs(store: TokenStore, tok) -> list[str]:
    """Decoded documents of a store (sequences of one doc joined), without special tokens."""
    out: dict[int, list[int]] = {}
    for i in range(len(store)):
        ids, _ = store.sequence(i)
        out.setdefault(int(store.doc_ids[i]), []).extend(ids.tolist())
    return [tok.decode(v, skip_special_tokens=True) for _, v in sorted(out.items())]


def jsonl_bytes(records: list) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def test_jsonl_plain_gz_zst_json_parquet_csv(tmp_path, tiny_model_dir, tiny_tokenizer, cache_dir):
    recs = [{"text": t} for t in TEXTS]
    files = {
        "a.jsonl": jsonl_bytes(recs),
        "a.jsonl.gz": gzip.compress(jsonl_bytes(recs)),
        "a.jsonl.zst": zstandard.ZstdCompressor().compress(jsonl_bytes(recs)),
        "a.json": json.dumps(recs).encode(),
    }
    for name, raw in files.items():
        (tmp_path / name).write_bytes(raw)
    pq.write_table(pa.table({"text": TEXTS, "other": [1, 2]}), tmp_path / "a.parquet")
    with open(tmp_path / "a.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "text"])
        for i, t in enumerate(TEXTS):
            w.writerow([i, t])
    for name in [*files, "a.parquet", "a.csv"]:
        p = prepare_data(cfg(tiny_model_dir, cache_dir, [tmp_path / name]), progress=False)
        assert docs(TokenStore(p.store_path), tiny_tokenizer) == TEXTS, name
        assert p.stats["documents"] == 2 and not p.cache_hit


def test_workers_give_identical_store(tmp_path, tiny_model_dir, cache_dir):
    from pitstop.core.corpus import sample_texts

    f = tmp_path / "c.jsonl"
    f.write_bytes(jsonl_bytes([{"text": t} for t in sample_texts(200)]))
    import pitstop.data.prepare as prep

    old = prep.CHUNK_BYTES
    prep.CHUNK_BYTES = 20_000  # many chunks, so ordering across workers is exercised
    try:
        a = open_store(cfg(tiny_model_dir, cache_dir / "1", [f], workers=1), progress=False)
        b = open_store(cfg(tiny_model_dir, cache_dir / "2", [f], workers=2), progress=False)
    finally:
        prep.CHUNK_BYTES = old
    for name in ("tokens", "mask", "offsets", "doc_ids"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a.manifest["stats"]["documents"] == 200


def test_text_file_is_one_document(tmp_path, tiny_model_dir, tiny_tokenizer, cache_dir):
    body = "First paragraph.\n\nSecond paragraph, same document.\n"
    (tmp_path / "a.txt").write_text(body)
    (tmp_path / "b.md").write_text("Another file.")
    p = prepare_data(
        cfg(tiny_model_dir, cache_dir, [tmp_path / "a.txt", tmp_path / "b.md"]), progress=False
    )
    assert docs(TokenStore(p.store_path), tiny_tokenizer) == [body, "Another file."]


def test_huge_text_file_split_at_blank_lines(tmp_path, tiny_model_dir, cache_dir, monkeypatch):
    import pitstop.data.readers as readers

    monkeypatch.setattr(readers, "TEXT_SPLIT_BYTES", 1000)
    monkeypatch.setattr(readers, "TEXT_PIECE_BYTES", 300)
    paras = [f"Paragraph number {i} of a long dump." for i in range(60)]
    (tmp_path / "big.txt").write_text("\n\n".join(paras))
    p = prepare_data(cfg(tiny_model_dir, cache_dir, [tmp_path / "big.txt"]), progress=False)
    assert 3 < p.stats["documents"] < 60


def test_multiple_files_concatenate_in_order(tmp_path, tiny_model_dir, tiny_tokenizer, cache_dir):
    (tmp_path / "1.jsonl").write_bytes(jsonl_bytes([{"text": "one"}, {"text": "two"}]))
    (tmp_path / "2.txt").write_text("three")
    (tmp_path / "3.json").write_text(json.dumps([{"text": "four"}]))
    c = cfg(
        tiny_model_dir, cache_dir, [tmp_path / "1.jsonl", tmp_path / "2.txt", tmp_path / "3.json"]
    )
    s = open_store(c, progress=False)
    assert docs(s, tiny_tokenizer) == ["one", "two", "three", "four"]
    assert list(s.doc_ids) == [0, 1, 2, 3]


def test_valid_oddities_bom_crlf_blank_lines_extra_fields(
    tmp_path, tiny_model_dir, tiny_tokenizer, cache_dir
):
    raw = b'\xef\xbb\xbf{"text": "alpha", "id": 7}\r\n\r\n   \n{"text": "beta", "meta": {"x": [1]}}\r\n'
    (tmp_path / "odd.jsonl").write_bytes(raw)
    s = open_store(cfg(tiny_model_dir, cache_dir, [tmp_path / "odd.jsonl"]), progress=False)
    assert docs(s, tiny_tokenizer) == ["alpha", "beta"]
    (tmp_path / "odd.csv").write_bytes(b'\xef\xbb\xbftext,n\r\n"multi\r\nline",1\r\nplain,2\r\n')
    s = open_store(cfg(tiny_model_dir, cache_dir, [tmp_path / "odd.csv"]), progress=False)
    assert docs(s, tiny_tokenizer) == ["multi\r\nline", "plain"]


def test_format_override_and_custom_fields(tmp_path, tiny_model_dir, tiny_tokenizer, cache_dir):
    (tmp_path / "data.log").write_bytes(jsonl_bytes([{"body": "custom field"}]))
    c = cfg(tiny_model_dir, cache_dir, [tmp_path / "data.log"], format="jsonl", text_field="body")
    assert docs(open_store(c, progress=False), tiny_tokenizer) == ["custom field"]


def test_parquet_and_csv_chat_records(tmp_path, tiny_model_dir, cache_dir):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    pq.write_table(pa.table({"messages": [msgs]}), tmp_path / "c.parquet")
    with open(tmp_path / "c.csv", "w", newline="") as f:
        csv.writer(f).writerows([["messages"], [json.dumps(msgs)]])
    a = open_store(cfg(tiny_model_dir, cache_dir, [tmp_path / "c.parquet"]), progress=False)
    b = open_store(cfg(tiny_model_dir, cache_dir, [tmp_path / "c.csv"]), progress=False)
    assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.mask, b.mask)
    assert a.manifest["stats"]["record_kinds"] == {"chat": 1}
