"""Bad input: a DataError naming file:line, what is wrong and the fix; or skipped and counted."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import zstandard

from pitstop.core.config import RunConfig
from pitstop.core.errors import DataError
from pitstop.data.prepare import prepare_data

GOOD = b'{"text": "fine"}\n'


def cfg(model: Path, cache: Path, data: list, **kw) -> RunConfig:
    return RunConfig(
        data=[str(d) for d in data],
        model=str(model),
        cache_dir=str(cache),
        workers=kw.pop("workers", 1),
        **kw,
    )


def fails(tmp_path, model, cache, name: str, raw: bytes, pattern: str, **kw) -> str:
    f = tmp_path / name
    f.write_bytes(raw)
    with pytest.raises(DataError) as e:
        prepare_data(cfg(model, cache, [f], **kw), progress=False)
    msg = str(e.value)
    assert "Traceback" not in msg
    import re

    assert re.search(pattern, msg), msg
    return msg


RECORD_CASES = [
    ("invalid_json", b'{"text": "a"\n', r"x\.jsonl:2: invalid JSON at column \d+"),
    (
        "missing_fields",
        b'{"body": "a", "id": 1}\n',
        r"x\.jsonl:2: no known record shape: found fields \['body', 'id'\].*--text-field",
    ),
    ("partial_shape", b'{"prompt": "a"}\n', r"x\.jsonl:2: .*needs both 'prompt' and 'completion'"),
    ("wrong_type", b'{"text": 5}\n', r"x\.jsonl:2: field 'text' must be a string, got a number"),
    ("null_text", b'{"text": null}\n', r"x\.jsonl:2: field 'text' must be a string, got null"),
    ("empty_text", b'{"text": "  "}\n', r"x\.jsonl:2: field 'text' is empty"),
    ("not_object", b"[1, 2]\n", r"x\.jsonl:2: a record must be an object"),
    ("invalid_utf8", b'{"text": "caf\xe9"}\n', r"x\.jsonl:2: invalid UTF-8 at byte 13"),
    ("nul_byte", b'{"text": "a\x00b"}\n', r"x\.jsonl:2: the line contains a NUL byte"),
    (
        "nul_escape",
        b'{"text": "a\\u0000b"}\n',
        r"x\.jsonl:2: field 'text' contains a NUL character",
    ),
    (
        "unknown_role",
        b'{"messages": [{"role": "wizard", "content": "x"}]}\n',
        r"x\.jsonl:2: message 0 has unknown role 'wizard'",
    ),
    (
        "messages_not_list",
        b'{"messages": {"role": "user"}}\n',
        r"x\.jsonl:2: field 'messages' must be a list",
    ),
    (
        "message_content_null",
        b'{"messages": [{"role": "user", "content": null}]}\n',
        r"x\.jsonl:2: message 0 content must be a string",
    ),
]


@pytest.mark.parametrize(
    ("case", "line", "pattern"), RECORD_CASES, ids=[c[0] for c in RECORD_CASES]
)
def test_bad_record_errors(tmp_path, tiny_model_dir, cache_dir, case, line, pattern):
    msg = fails(tmp_path, tiny_model_dir, cache_dir, "x.jsonl", GOOD + line + GOOD, pattern)
    assert "--on-bad-record skip" in msg


def test_errors_come_back_from_worker_processes(tmp_path, tiny_model_dir, cache_dir):
    fails(
        tmp_path,
        tiny_model_dir,
        cache_dir,
        "x.jsonl",
        GOOD * 3 + b'{"text": 1}\n',
        r"x\.jsonl:4: field 'text' must be a string",
        workers=2,
    )


def test_file_level_errors(tmp_path, tiny_model_dir, cache_dir):
    m, c = tiny_model_dir, cache_dir
    good = GOOD * 200
    fails(tmp_path, m, c, "x.parquet", good, r"x\.parquet: not a readable Parquet file")
    fails(
        tmp_path,
        m,
        c,
        "x.jsonl.gz",
        good,
        r"x\.jsonl\.gz: the extension says gzip .* not gzip-compressed",
    )
    fails(tmp_path, m, c, "y.jsonl.zst", good, r"y\.jsonl\.zst: the extension says zstd")
    gz = gzip.compress(good)
    fails(
        tmp_path,
        m,
        c,
        "t.jsonl.gz",
        gz[: len(gz) // 2],
        r"t\.jsonl\.gz: the compressed file is truncated",
    )
    zs = zstandard.ZstdCompressor().compress(good)
    fails(
        tmp_path,
        m,
        c,
        "t.jsonl.zst",
        zs[: len(zs) // 2],
        r"t\.jsonl\.zst: the compressed file is truncated",
    )
    fails(tmp_path, m, c, "e.jsonl", b"", r"e\.jsonl: the file is empty")
    fails(tmp_path, m, c, "b.jsonl", b"\n\n  \n", r"b\.jsonl: no records found")
    fails(tmp_path, m, c, "x.xlsx", good, r"cannot tell the format .* --format")
    fails(tmp_path, m, c, "a.json", good, r"a\.json:2: invalid JSON .*rename it to \.jsonl")
    fails(tmp_path, m, c, "o.json", b'{"text": "a"}', r"o\.json: a \.json file must hold an array")
    fails(tmp_path, m, c, "r.csv", b'text\n"unclosed\n', r"r\.csv:2: ")
    fails(tmp_path, m, c, "h.csv", b"body\nx\n", r"h\.csv:1: the CSV header names none")
    fails(
        tmp_path,
        m,
        c,
        "w.csv",
        b"text,n\na,1,extra\n",
        r"w\.csv:2: the row has 3 fields but the header has 2",
    )
    fails(tmp_path, m, c, "u.csv", b"text\nok\ncaf\xe9\n", r"u\.csv:3: invalid UTF-8")
    fails(tmp_path, m, c, "bin.txt", b"abc\x00\x01\x02", r"bin\.txt: NUL byte at line 1")
    fails(tmp_path, m, c, "l1.txt", b"ok\ncaf\xe9", r"l1\.txt: invalid UTF-8 at line 2")
    with pytest.raises(DataError, match="no such file"):
        prepare_data(cfg(m, c, [tmp_path / "missing.jsonl"]), progress=False)
    (tmp_path / "dir").mkdir()
    with pytest.raises(DataError, match="is a directory"):
        prepare_data(cfg(m, c, [tmp_path / "dir"]), progress=False)


def test_file_errors_also_in_skip_mode(tmp_path, tiny_model_dir, cache_dir):
    gz = gzip.compress(GOOD * 200)
    fails(
        tmp_path,
        tiny_model_dir,
        cache_dir,
        "t.jsonl.gz",
        gz[:-20],
        r"truncated",
        on_bad_record="skip",
    )


def test_skip_mode_counts_and_keeps_ten_examples(tmp_path, tiny_model_dir, cache_dir):
    lines = [GOOD] + [b'{"text": %d}\n' % i for i in range(15)] + [b"not json\n", GOOD]
    f = tmp_path / "s.jsonl"
    f.write_bytes(b"".join(lines))
    p = prepare_data(cfg(tiny_model_dir, cache_dir, [f], on_bad_record="skip"), progress=False)
    st = p.stats
    assert st["bad_records"] == 16 and st["documents"] == 2 and st["records_read"] == 18
    assert len(st["bad_examples"]) == 10
    assert st["bad_examples"][0] == {
        "where": f"{f}:2",
        "reason": "field 'text' must be a string, got a number",
    }
    json.dumps(st)  # the stats are JSON-serialisable


def test_all_bad_is_an_error(tmp_path, tiny_model_dir, cache_dir):
    fails(
        tmp_path,
        tiny_model_dir,
        cache_dir,
        "a.jsonl",
        b'{"x": 1}\n',
        r"no usable documents: all 1 records were bad",
        on_bad_record="skip",
    )


def test_store_with_other_data_and_no_tokenizer(tmp_path, tiny_model_dir, cache_dir):
    from pitstop.core.errors import ConfigError

    f = tmp_path / "a.jsonl"
    f.write_bytes(GOOD)
    p = prepare_data(cfg(tiny_model_dir, cache_dir, [f]), progress=False)
    with pytest.raises(DataError, match="can only be given alone"):
        prepare_data(cfg(tiny_model_dir, cache_dir, [p.store_path, f]), progress=False)
    with pytest.raises(ConfigError, match="does not exist"):
        prepare_data(cfg(tmp_path / "nomodel", cache_dir, [f]), progress=False)
