"""Issue 33, item 2: a dataset whose records carry no target but EOS is refused, not trained.

Before: 60 ShareGPT records with no assistant turn (or 60 chats holding only a system
message) prepared to one EOS target per record (or none), trained to "completed" and wrote
`final/`; nothing told the user (typically a role-name mistake). Now `prepare` counts the
records whose only target is their EOS and warns from EOS_ONLY_WARN_SHARE of the records
on, naming the count and the likely cause; `train` refuses a store where every record is
such (exit 2, nothing written to the output directory) and warns like prepare otherwise.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from pitstop.cli import main
from pitstop.data.stats import EOS_ONLY_WARN_SHARE, eos_only_message
from pitstop.data.store import TokenStore, target_free_documents

# The tiny tokenizer's template ends every turn with </s>, so a chat without an assistant
# turn has no target at all; this one ends turns with a newline, so each such record
# keeps exactly one target, the EOS that prepare appends (the "target tokens 60").
NO_EOS_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"


def sharegpt_no_assistant(i: int) -> dict:
    return {
        "conversations": [
            {"from": "system", "value": "Answer from the book."},
            {"from": "human", "value": f"What happened on day {i}?"},
        ]
    }


def system_only(i: int) -> dict:
    return {"messages": [{"role": "system", "content": f"You are helper number {i}."}]}


def real_chat(i: int) -> dict:
    return {
        "conversations": [
            {"from": "human", "value": f"What happened on day {i}?"},
            {"from": "gpt", "value": f"On day {i} the waters were divided from the waters."},
        ]
    }


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def no_eos_model(tmp_path_factory, tiny_model_dir: Path) -> Path:
    dst = tmp_path_factory.mktemp("tpl") / "model"
    shutil.copytree(tiny_model_dir, dst)
    cfg_path = dst / "tokenizer_config.json"
    tc = json.loads(cfg_path.read_text())
    tc["chat_template"] = NO_EOS_TEMPLATE
    cfg_path.write_text(json.dumps(tc))
    for extra in dst.glob("chat_template.*"):
        extra.unlink()
    return dst


def prepare(model: Path, data: Path, capsys) -> tuple[dict, str]:
    argv = ["prepare", "--model", str(model), "--data", str(data), "--cache-dir",
            str(data.parent / "cache"), "--workers", "1", "--json"]  # fmt: skip
    assert main(argv) == 0
    cap = capsys.readouterr()
    return json.loads(cap.out), cap.err


def train_argv(model: Path, data: Path, out: Path) -> list[str]:
    return [
        "train", "--model", str(model), "--data", str(data), "--output", str(out),
        "--max-seq-len", "64", "--tokens-per-step", "128", "--micro-batch-size", "2",
        "--batching", "pack", "--max-steps", "2", "--save-steps", "2", "--report-to", "none",
        "--compile", "off", "--cache-dir", str(data.parent / "cache"),
    ]  # fmt: skip


@pytest.mark.parametrize("make", [sharegpt_no_assistant, system_only])
@pytest.mark.parametrize("template", ["tiny", "no_eos"])
def test_prepare_warns_when_every_record_has_nothing_to_learn(
    make, template, tmp_path, tiny_model_dir, no_eos_model, capsys
):
    model = tiny_model_dir if template == "tiny" else no_eos_model
    data = write_jsonl(tmp_path / "d.jsonl", [make(i) for i in range(60)])
    stats, err = prepare(model, data, capsys)
    assert stats["eos_only_documents"] == {"count": 60, "of": 60, "by_kind": {"chat": 60}}
    assert stats["target_tokens"] == (60 if template == "no_eos" else 0)
    assert "warning: all 60 records carry no loss target but the end-of-sequence token" in err
    assert "no assistant turn found in 60 chat records" in err
    assert '"from": "gpt"' in err and "--train-on-prompt" in err
    assert "`pitstop train` refuses it" in err
    again = prepare(model, data, capsys)  # a cache hit warns the same
    assert again[0]["cache_hit"] and "all 60 records" in again[1]


@pytest.mark.slow
@pytest.mark.parametrize("make", [sharegpt_no_assistant, system_only])
def test_train_refuses_records_with_nothing_to_learn(make, tmp_path, no_eos_model, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", [make(i) for i in range(60)])
    out = tmp_path / "out"
    rc = main(train_argv(no_eos_model, data, out))
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"nothing to train on in {data}" in err and "all 60 records carry no loss target" in err
    assert "no assistant turn found" in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize(
    ("n_empty", "n_real", "warns"),
    [(2, 298, False), (10, 90, True)],  # 0.67% and 10% of the records
)
def test_a_share_of_empty_records_warns_above_the_threshold(
    n_empty, n_real, warns, tmp_path, tiny_model_dir, capsys
):
    assert (n_empty / (n_empty + n_real) >= EOS_ONLY_WARN_SHARE) == warns
    records = [real_chat(i) for i in range(n_real)]
    for k in range(n_empty):
        records.insert(k * 7, sharegpt_no_assistant(k))
    data = write_jsonl(tmp_path / "d.jsonl", records)
    stats, err = prepare(tiny_model_dir, data, capsys)
    total = n_empty + n_real
    assert stats["eos_only_documents"]["count"] == n_empty
    assert stats["eos_only_documents"]["of"] == total
    if warns:
        assert f"{n_empty} of {total} records ({n_empty / total:.1%}) carry" in err
        assert "no assistant turn found in 10 chat records" in err and "refuses" not in err
    else:
        assert "warning" not in err


@pytest.mark.slow
def test_train_proceeds_and_warns_with_a_share_of_empty_records(tmp_path, tiny_model_dir, capsys):
    records = [real_chat(i) for i in range(90)] + [sharegpt_no_assistant(i) for i in range(10)]
    data = write_jsonl(tmp_path / "d.jsonl", records)
    out = tmp_path / "out"
    rc = main(train_argv(tiny_model_dir, data, out))
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "warning: 10 of 100 records (10.0%) carry no loss target" in err
    assert (out / "final").is_dir()


def test_the_cause_follows_the_record_shapes():
    """Texts of one token (a tokenizer without BOS) and truncated completions have causes
    of their own; a store that does not say its shapes gets every likely cause."""
    stats = {"max_seq_len": 64, "long_documents": {"policy": "truncate", "targets_removed": 9}}
    msg = eos_only_message({"count": 20, "of": 20, "by_kind": {"text": 20}}, stats)
    assert msg.startswith("all 20 records carry") and "20 text records are one token long" in msg
    assert "--text-field" in msg and "assistant" not in msg
    assert "--long-docs truncate removed 9 target tokens past --max-seq-len 64" in msg
    msg = eos_only_message({"count": 3, "of": 100, "by_kind": {}}, {})
    assert msg.startswith("3 of 100 records (3.0%) carry")
    assert "no assistant turn found:" in msg and "--text-field" in msg
    assert eos_only_message({"count": 0, "of": 100, "by_kind": {}}, {}) is None
    assert eos_only_message(None, {}) is None


def test_target_free_documents_spans_split_documents():
    # doc 0: two sequences, a target mid-document; doc 1: only its last token (EOS);
    # doc 2: no target at all; doc 3 (split in two): only its last token.
    mask = np.array([0, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 1], dtype=np.uint8)
    offsets = np.array([0, 2, 4, 6, 8, 10, 12])
    doc_ids = np.array([0, 0, 1, 2, 3, 3])
    held, free = target_free_documents(mask, offsets, doc_ids)
    assert held.tolist() == [0, 1, 2, 3] and free.tolist() == [False, True, True, True]
    held, free = target_free_documents(mask[:0], offsets[:1], doc_ids[:0])
    assert len(held) == len(free) == 0


def test_a_store_from_before_the_count_is_checked_from_its_mask(
    tmp_path, tiny_model_dir, no_eos_model, capsys
):
    """No "eos_only_documents" in the manifest: found from the loss mask, or None (cheap)."""
    from pitstop.core.config import build_config
    from pitstop.core.errors import ConfigError
    from pitstop.train.data import check_targets

    def old_store(model: Path, records: list[dict], name: str) -> TokenStore:
        d = tmp_path / name
        d.mkdir()
        stats, _ = prepare(model, write_jsonl(d / "d.jsonl", records), capsys)
        m = json.loads((Path(stats["store"]) / "manifest.json").read_text())
        del m["stats"]["eos_only_documents"]
        (Path(stats["store"]) / "manifest.json").write_text(json.dumps(m))
        return TokenStore(stats["store"])

    empty = old_store(no_eos_model, [sharegpt_no_assistant(i) for i in range(60)], "a")
    assert empty.eos_only_documents() == {"count": 60, "of": 60, "by_kind": {"chat": 60}}
    cfg = build_config({"model": str(no_eos_model), "data": [str(empty.path)],
                        "output": str(tmp_path / "out")}, command="train")  # fmt: skip
    with pytest.raises(ConfigError, match="all 60 records carry no loss target") as e:
        check_targets(empty, cfg)
    assert "no assistant turn found in 60 chat records" in str(e.value)
    m = json.loads((empty.path / "manifest.json").read_text())
    del m["stats"]["record_kinds"]  # shapes unknown: every likely cause is named
    (empty.path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ConfigError, match=r"no assistant turn found: .*--text-field"):
        check_targets(TokenStore(empty.path), cfg)
    real = old_store(tiny_model_dir, [real_chat(i) for i in range(30)], "b")
    assert real.eos_only_documents() is None  # more targets than records: not all empty
    check_targets(real, cfg)
