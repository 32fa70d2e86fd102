"""Hostile dataset files through the real `pitstop prepare`: a clear error or a counted skip.

Each case is a file with good records around one bad one (or a file bad as a whole).
With the default `--on-bad-record error` the CLI must exit non-zero with a message that
names `file:line` (where a line applies), what is wrong and what to do, and no
traceback. With `--on-bad-record skip` a bad record is skipped and counted
(`bad_records` in `--json`), while a file bad as a whole is still an error. Most
cases run in-process through `pitstop.cli.main` (fast); a few run as subprocesses.
tests/test_data_errors.py checks the library messages; this file checks the command.
"""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import zstandard
from _rel import env
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

GOOD = b'{"text": "fine"}\n'
SKIP_HINT = "--on-bad-record skip"

# (id, bad line, message regex after "FILE:2: ")
RECORDS = [
    ("truncated-json", b'{"text": "a', r"invalid JSON at column \d+"),
    ("trailing-garbage", b'{"text": "a"} x', r"invalid JSON at column \d+: Extra data"),
    ("text-number", b'{"text": 5}', r"field 'text' must be a string, got a number"),
    ("text-list", b'{"text": ["a"]}', r"field 'text' must be a string, got an array"),
    ("text-object", b'{"text": {"a": 1}}', r"field 'text' must be a string, got an object"),
    ("text-null", b'{"text": null}', r"field 'text' must be a string, got null"),
    ("text-empty", b'{"text": ""}', r"field 'text' is empty; remove the record or fill it in"),
    ("text-whitespace", b'{"text": " \\t\\n "}', r"field 'text' is empty"),
    ("text-nan", b'{"text": NaN}', r"field 'text' must be a string, got a number"),
    ("missing-fields", b'{"body": "a"}', r"no known record shape: found fields \['body'\].*--\*-field"),
    ("only-unknown-fields", b'{"foo": 1, "bar": 2}', r"no known record shape: found fields \['bar', 'foo'\]"),
    ("empty-object", b"{}", r"no known record shape: found fields \[\]"),
    ("scalar-number", b"42", r"a record must be an object .*got a number"),
    ("scalar-string", b'"hello"', r"a record must be an object .*got a string"),
    ("scalar-null", b"null", r"a record must be an object .*got null"),
    ("scalar-bool", b"true", r"a record must be an object .*got a boolean"),
    ("array", b'[{"text": "a"}]', r"a record must be an object .*got an array"),
    ("invalid-utf8", b'{"text": "caf\xe9"}', r"invalid UTF-8 at byte \d+ of the line; re-encode the file as UTF-8"),
    ("nul-byte", b'{"text": "a\x00b"}', r"the line contains a NUL byte"),
    ("nul-escape", b'{"text": "a\\u0000b"}', r"contains a NUL character .*clean the data"),
    ("deeply-nested", b'{"text": ' + b"[" * 100_000, r"invalid JSON: nested too deeply"),
    ("prompt-no-completion", b'{"prompt": "q"}', r"needs both 'prompt' and 'completion'"),
    ("completion-no-prompt", b'{"completion": "a"}', r"needs both 'prompt' and 'completion'"),
    ("prompt-number", b'{"prompt": 1, "completion": "a"}', r"field 'prompt' must be a string"),
    ("completion-empty", b'{"prompt": "q", "completion": ""}', r"field 'completion' is empty"),
    ("instruction-no-output", b'{"instruction": "do"}', r"needs both 'instruction' and 'output'"),
    ("instruction-input-number", b'{"instruction": "a", "output": "b", "input": 3}', r"field 'input' must be a string or absent"),
    ("chat-unknown-role", b'{"messages": [{"role": "wizard", "content": "x"}]}', r"message 0 has unknown role 'wizard'; expected one of"),
    ("chat-not-list", b'{"messages": "hi"}', r"field 'messages' must be a list .*got a string"),
    ("chat-object", b'{"messages": {"role": "user"}}', r"field 'messages' must be a list .*got an object"),
    ("chat-empty", b'{"messages": []}', r"field 'messages' is an empty list"),
    ("chat-message-scalar", b'{"messages": ["hi"]}', r"message 0 of 'messages' must be an object with 'role' and 'content'"),
    ("chat-no-content", b'{"messages": [{"role": "user"}]}', r"message 0 of 'messages' must be an object .*got \['role'\]"),
    ("chat-content-null", b'{"messages": [{"role": "user", "content": null}]}', r"message 0 content must be a string, got null"),
    ("huge-integer", b'{"text": 1' + b"0" * 5000 + b"}", r"invalid JSON"),
]  # fmt: skip

_GZ = gzip.compress(GOOD * 300)
_ZS = zstandard.ZstdCompressor().compress(GOOD * 300)

# (id, file name, content, message regex, line-specific) -- bad as a whole: an error even in skip mode
FILES = [
    ("empty-file", "e.jsonl", b"", r"e\.jsonl: the file is empty; give a file with records"),
    ("whitespace-only", "w.jsonl", b"\n \n\t\r\n", r"w\.jsonl: no records found"),
    ("parquet-holding-jsonl", "p.parquet", GOOD * 50, r"p\.parquet: not a readable Parquet file .*--format"),
    ("gz-not-gzip", "g.jsonl.gz", GOOD * 50, r"g\.jsonl\.gz: the extension says gzip .*rename it without \.gz"),
    ("zst-not-zstd", "z.jsonl.zst", GOOD * 50, r"z\.jsonl\.zst: the extension says zstd"),
    ("jsonl-holding-gzip", "c.jsonl", _GZ, r"c\.jsonl: the file is gzip-compressed .*rename it to c\.jsonl\.gz"),
    ("truncated-gz", "t.jsonl.gz", _GZ[: len(_GZ) // 2], r"t\.jsonl\.gz: the compressed file is truncated .*fetch it again"),
    ("truncated-zst", "t.jsonl.zst", _ZS[: len(_ZS) // 2], r"t\.jsonl\.zst: the compressed file is truncated"),
    ("corrupt-gz", "k.jsonl.gz", _GZ[:20] + b"\x00" * 200 + _GZ[220:], r"k\.jsonl\.gz: the compressed data is corrupt|truncated"),
    ("csv-holding-jsonl", "j.csv", GOOD * 5, r"j\.csv:1: the CSV header names none of the record fields"),
    ("csv-unclosed-quote", "q.csv", b'text\n"unclosed\n', r"q\.csv:2: cannot parse the CSV row"),
    ("csv-wrong-columns", "n.csv", b"text,n\na,1,extra\n", r"n\.csv:2: the row has 3 fields but the header has 2"),
    ("csv-invalid-utf8", "u.csv", b"text\nok\ncaf\xe9\n", r"u\.csv:3: invalid UTF-8 .*re-encode"),
    ("csv-deep-messages", "m.csv", b'messages\n"' + b"[" * 100_000 + b'"\n', r"m\.csv:2: field 'messages' is a string that is not a valid JSON list"),
    ("json-holding-jsonl", "a.json", GOOD * 3, r"a\.json:2: invalid JSON .*rename it to \.jsonl"),
    ("json-object", "o.json", b'{"text": "a"}', r"o\.json: a \.json file must hold an array"),
    ("json-deeply-nested", "d.json", b"[" * 100_000, r"d\.json: invalid JSON: nested too deeply"),
    ("text-binary", "b.txt", b"abc\x00\x01\x02", r"b\.txt: NUL byte at line 1"),
    ("unknown-extension", "x.xlsx", GOOD, r"cannot tell the format from the extension '\.xlsx'.*--format"),
]  # fmt: skip


# Cases above that are one bad record rather than a bad file.
ONE_BAD_RECORD = {"csv-wrong-columns", "csv-deep-messages", "text-binary"}


def _prepare(args: list[str], capsys) -> tuple[int, str, str]:
    from pitstop.cli import main

    try:
        rc = main(["prepare", "--workers", "1", *args])
    except Exception as e:  # the real CLI would print a traceback
        pytest.fail(f"uncaught {type(e).__name__}: {str(e)[:500]}")
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return rc, out, err


def _message(err: str) -> str:
    """The error the CLI printed (after any progress-bar output)."""
    head = "pitstop prepare: error: "
    assert head in err, err[-1000:]
    return err[err.index(head) + len(head) :]


def _args(model: Path, cache: Path, data: Path, *extra: str) -> list[str]:
    return ["--model", str(model), "--cache-dir", str(cache), "--data", str(data), *extra]


def _no_store_left(cache: Path) -> None:
    from pitstop.data.store import is_store

    stores = cache / "stores"
    assert not (stores.is_dir() and any(is_store(p) for p in stores.iterdir()))


@pytest.mark.parametrize(("case", "line", "pattern"), RECORDS, ids=[c[0] for c in RECORDS])
def test_bad_record_is_a_clear_error(case, line, pattern, tiny_model_dir, tmp_path, capsys):
    f = tmp_path / "x.jsonl"
    f.write_bytes(GOOD + line + b"\n" + GOOD)
    cache = tmp_path / "cache"
    rc, _, err = _prepare(_args(tiny_model_dir, cache, f), capsys)
    assert rc == 1, err
    msg = _message(err)
    assert msg.startswith(f"{f}:2: "), msg[:500]
    assert re.search(pattern, msg), msg[:800]
    assert SKIP_HINT in msg  # the other way out, besides fixing the record
    _no_store_left(cache)


def test_every_bad_record_is_skipped_and_counted(tiny_model_dir, tmp_path, capsys):
    """All the bad lines above in one file, each after a good one: skip mode counts each."""
    f = tmp_path / "x.jsonl"
    f.write_bytes(b"".join(GOOD + line + b"\n" for _, line, _ in RECORDS) + GOOD)
    rc, out, err = _prepare(
        _args(tiny_model_dir, tmp_path / "c", f, "--on-bad-record", "skip", "--json"), capsys
    )
    assert rc == 0, err
    stats = json.loads(out)
    n = len(RECORDS)
    assert stats["bad_records"] == n and stats["documents"] == n + 1
    assert stats["records_read"] == 2 * n + 1
    shown = stats["bad_examples"]
    assert [e["where"] for e in shown] == [f"{f}:{2 * i + 2}" for i in range(len(shown))]
    for e, (_, _, pattern) in zip(shown, RECORDS):
        assert re.search(pattern, e["reason"]), e


@pytest.mark.parametrize(("case", "name", "raw", "pattern"), FILES, ids=[c[0] for c in FILES])
def test_bad_file_is_a_clear_error_even_when_skipping(
    case, name, raw, pattern, tiny_model_dir, tmp_path, capsys
):
    f = tmp_path / name
    f.write_bytes(raw)
    for extra in ([], ["--on-bad-record", "skip"]):
        rc, _, err = _prepare(_args(tiny_model_dir, tmp_path / "cache", f, *extra), capsys)
        if case in ONE_BAD_RECORD and extra:  # skipped, and it was the file's only record
            assert rc == 1 and "no usable documents: all 1 records were bad" in err, err[-800:]
            continue
        assert rc == 1, err
        msg = _message(err)
        assert msg.startswith(str(tmp_path)), msg[:300]
        assert re.search(pattern, msg), msg[:800]


def test_missing_path_and_directory(tiny_model_dir, tmp_path, capsys):
    rc, _, err = _prepare(_args(tiny_model_dir, tmp_path / "c", tmp_path / "nope.jsonl"), capsys)
    assert rc == 1 and "nope.jsonl: no such file; check the --data path" in err
    (tmp_path / "dir").mkdir()
    rc, _, err = _prepare(_args(tiny_model_dir, tmp_path / "c", tmp_path / "dir"), capsys)
    assert (
        rc == 1 and "is a directory, not a dataset file" in err and "give the data file(s)" in err
    )


def test_valid_oddities_prepare_normally(tiny_model_dir, tmp_path, capsys):
    """BOM, CRLF, blank lines, no final newline, unknown extra fields, unicode: all fine."""
    f = tmp_path / "odd.jsonl"
    f.write_bytes(b'\xef\xbb\xbf{"text": "alpha", "id": 7}\r\n\r\n  \n{"text": "\xc3\xa9t\xc3\xa9 \\ud83d\\ude00"}\r\n'
                  b'{"prompt": "", "completion": "b"}')  # fmt: skip
    rc, out, err = _prepare(_args(tiny_model_dir, tmp_path / "c", f, "--json"), capsys)
    assert rc == 0, err
    s = json.loads(out)
    assert s["documents"] == 3 and s["bad_records"] == 0


SUBPROCESS_CASES = [
    ("truncated-gz", "t.jsonl.gz", _GZ[:-40], "the compressed file is truncated"),
    ("invalid-utf8", "u.jsonl", GOOD + b'{"text": "\xff"}\n', "u.jsonl:2: invalid UTF-8"),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "name", "raw", "needle"), SUBPROCESS_CASES, ids=[c[0] for c in SUBPROCESS_CASES]
)
def test_real_process_exit_code_and_message(case, name, raw, needle, tiny_model_dir, tmp_path):
    f = tmp_path / name
    f.write_bytes(raw)
    r = subprocess.run([sys.executable, "-m", "pitstop", "prepare", *_args(tiny_model_dir, tmp_path / "c", f)],
                       env=env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 1 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr[
        -2000:
    ]


# peak_memory reads VmHWM: ru_maxrss would carry over the pytest worker's peak at exec.
_HUGE = """
import json, resource, sys, time
from pitstop.measure.memory import peak_memory
from pitstop.cli import main
t = time.perf_counter()
rc = main(["prepare", "--model", sys.argv[1], "--data", sys.argv[2], "--cache-dir", sys.argv[3], "--workers", "2"])
print(json.dumps({"rc": rc, "seconds": time.perf_counter() - t,
    "self_mb": peak_memory("cpu") / 2**20,
    "children_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""


@pytest.mark.slow
def test_a_100mb_single_line_is_bounded(tiny_model_dir, tmp_path):
    """One 100 MB line (an unterminated string: a broken export) fails fast in bounded memory."""
    f = tmp_path / "huge.jsonl"
    with open(f, "wb") as out:
        out.write(GOOD + b'{"text": "')
        chunk = b"abcdefgh " * (1 << 17)
        for _ in range(100 * (1 << 20) // len(chunk)):
            out.write(chunk)
        out.write(b"\n" + GOOD)
    r = subprocess.run([sys.executable, "-c", _HUGE, str(tiny_model_dir), str(f), str(tmp_path / "c")],
                       env=env(), capture_output=True, text=True, timeout=600)  # fmt: skip
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    assert m["rc"] == 1 and f"{f}:2: invalid JSON" in r.stderr, r.stderr[-1000:]
    assert m["self_mb"] < 1500 and m["children_mb"] < 1500, m  # a few copies of the line at most
    print(m)


# --- property-based: generated files through the full prepare path --------------------

_VALID = st.sampled_from([
    {"text": "some words"}, {"prompt": "q?", "completion": "a."},
    {"instruction": "do", "output": "done"}, {"instruction": "do", "input": "x", "output": "y"},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
])  # fmt: skip
_JUNK = st.one_of(
    st.binary(max_size=40).filter(lambda b: b"\n" not in b and b"\r" not in b),
    st.sampled_from(
        [b"{", b"null", b"[]", b'{"text": 3}', b'{"messages": [1]}', b"\x00", b"\xff\xfe"]
    ),
)
_LINE = st.one_of(_VALID.map(lambda v: json.dumps(v).encode()), _JUNK, st.just(b""))


@pytest.mark.slow
@given(
    lines=st.lists(_LINE, min_size=1, max_size=12),
    crlf=st.booleans(),
    bom=st.booleans(),
    gz=st.booleans(),
)
# Found by a soak pass (stop 30): a junk first line that opens with zstd's magic bytes.
@example(lines=[b"\x28\xb5\x2f\xfd{"], crlf=False, bom=False, gz=False)
# Found by CI-like run (2026-11-26): a junk line that is a UTF-16 byte-order mark.
@example(lines=[b"\xfe\xff"], crlf=False, bom=False, gz=False)
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_generated_files_count_every_line(tiny_model_dir, tmp_path_factory, lines, crlf, bom, gz):
    """Any mix of good, junk and blank lines: prepare in skip mode either succeeds with
    documents + bad records == non-blank lines, or reports a DataError; never anything else."""
    from pitstop.core.config import RunConfig
    from pitstop.core.errors import DataError
    from pitstop.data.prepare import prepare_data

    d = tmp_path_factory.mktemp("gen")
    raw = (b"\r\n" if crlf else b"\n").join(lines) + b"\n"
    raw = (b"\xef\xbb\xbf" if bom else b"") + raw
    f = d / ("g.jsonl.gz" if gz else "g.jsonl")
    f.write_bytes(gzip.compress(raw) if gz else raw)
    cfg = RunConfig(data=[str(f)], model=str(tiny_model_dir), cache_dir=str(d / "c"), workers=1,
                    on_bad_record="skip")  # fmt: skip
    nonblank = sum(1 for ln in lines if ln.strip())
    try:
        st_ = prepare_data(cfg, progress=False).stats
    except DataError as e:
        assert str(e)
        if not gz and raw.startswith((b"\x1f\x8b", b"\x28\xb5\x2f\xfd")):
            # Junk that opens with gzip's or zstd's magic bytes (pitstop/data/readers.py
            # _MAGIC): a plain-named file is judged by its content and the user told to rename.
            assert "compressed but its name does not end in" in str(e), str(e)
            return
        head = raw[:64]
        if head.startswith((b"\xff\xfe", b"\xfe\xff")) or (
            len(head) >= 8 and bool(head[0::2].strip(b"\0")) != bool(head[1::2].strip(b"\0"))
        ):
            # Opens like UTF-16/32 (a wide byte-order mark, or NUL at every other byte): the
            # whole file is refused with its encoding named, not read line by line as UTF-8.
            assert "the file is encoded as" in str(e) and "not UTF-8" in str(e), str(e)
            return
        assert nonblank == 0 or "no usable documents" in str(e) or "no records found" in str(e), (
            str(e)
        )
        return
    assert st_["documents"] + st_["bad_records"] == st_["records_read"] == nonblank
