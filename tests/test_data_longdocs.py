"""Documents longer than max_seq_len: split (no token lost), truncate, drop, with counts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pitstop.core.config import RunConfig
from pitstop.data.prepare import open_store

L = 16


def setup(tmp_path: Path, model: Path, cache: Path, tok, policy: str, kind: str = "text"):
    words = [" ".join(["light"] * n) for n in (3, 30, 60, 10)]
    if kind == "text":
        recs = [{"text": w} for w in words]
    else:
        recs = [{"prompt": "Q:\n", "completion": w} for w in words]
    f = tmp_path / "l.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in recs))
    c = RunConfig(
        data=[str(f)],
        model=str(model),
        cache_dir=str(cache),
        workers=1,
        max_seq_len=L,
        long_docs=policy,
    )
    s = open_store(c, progress=False)
    full = [
        tok(r.get("text", "") or r["prompt"] + r["completion"])["input_ids"] + [tok.eos_token_id]
        for r in recs
    ]
    return s, full


def by_doc(s):
    out: dict[int, list[int]] = {}
    for i in range(len(s)):
        out.setdefault(int(s.doc_ids[i]), []).extend(s.sequence(i)[0].tolist())
    return out


def test_split_loses_no_token(tmp_path, tiny_model_dir, tiny_tokenizer, cache_dir):
    s, full = setup(tmp_path, tiny_model_dir, cache_dir, tiny_tokenizer, "split")
    assert s.lengths.max() <= L
    assert by_doc(s) == dict(enumerate(full))
    st = s.manifest["stats"]
    long = [len(x) for x in full if len(x) > L]
    ld = st["long_documents"]
    assert ld["count"] == len(long) and ld["policy"] == "split"
    assert ld["extra_chunks"] == sum(-(-n // L) - 1 for n in long)
    assert ld["targets_lost"] == ld["extra_chunks"]  # text: every chunk start was a target
    assert st["sequences"] == len(s) == sum(-(-len(x) // L) for x in full)
    assert st["tokens"] == sum(map(len, full))
    starts = np.asarray(s.offsets[:-1])
    assert not np.asarray(s.mask)[starts].any()  # no sequence starts with a target
    assert st["target_tokens"] == int(np.asarray(s.mask).sum())


def test_truncate_counts(tmp_path, tiny_model_dir, tiny_tokenizer, cache_dir):
    s, full = setup(tmp_path, tiny_model_dir, cache_dir, tiny_tokenizer, "truncate")
    assert by_doc(s) == {i: x[:L] for i, x in enumerate(full)}
    ld = s.manifest["stats"]["long_documents"]
    assert ld["tokens_removed"] == sum(max(0, len(x) - L) for x in full)
    assert ld["targets_removed"] == ld["tokens_removed"]
    assert ld["count"] == sum(len(x) > L for x in full)


def test_drop_counts(tmp_path, tiny_model_dir, tiny_tokenizer, cache_dir):
    s, full = setup(tmp_path, tiny_model_dir, cache_dir, tiny_tokenizer, "drop", kind="pc")
    kept = {i: x for i, x in enumerate(full) if len(x) <= L}
    assert by_doc(s) == kept  # doc ids keep their input position
    st = s.manifest["stats"]
    assert st["long_documents"]["count"] == len(full) - len(kept)
    assert st["long_documents"]["tokens_removed"] == sum(len(x) for x in full if len(x) > L)
    assert st["documents"] == len(full)  # read: 4, written: the ones that fit
