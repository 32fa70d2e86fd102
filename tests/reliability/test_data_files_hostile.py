"""Issue 33, "never tried": data files and paths as users have them, through `pitstop prepare`.

Each case ends in a correct result or a clear refusal (exit 1, one message naming the
file, the problem and the fix, no traceback, no store written, the input untouched):

- encodings: Latin-1 is named at its line; UTF-16 and UTF-32 (with or without a
  byte-order mark, compressed or not) are refused as a whole, naming the encoding,
  whatever --on-bad-record says (every line would be "bad");
- a UTF-8 BOM and CRLF line ends just work: the store is the one of the plain file;
  a CRLF corpus is cut at its blank lines; lone-CR line ends are named as such;
- symbolic links: a loop, a two-link loop and a dangling link are named as such; a
  link to a file and a folder with a loop inside are handled;
- patterns: a quoted `--data 'dir/*.jsonl'` reads its files in sorted order; one that
  matches nothing names the pattern; a file with `*` in its name is read as itself;
- paths with spaces and non-ASCII letters (data, model, cache) work; a file name that is
  not UTF-8 is refused with the fix.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _rel import env

from pitstop.data import readers
from pitstop.data.readers import iter_chunks
from pitstop.data.records import Fields
from pitstop.data.store import TokenStore, is_store

LINES = [{"text": "In the beginning was the word."}, {"text": "Café au lait, naïve façade."}]


def _jsonl(nl: bytes = b"\n") -> bytes:
    return b"".join(json.dumps(r, ensure_ascii=False).encode() + nl for r in LINES)


def _prepare(model: Path, cache: Path, *data: Path | str, extra: tuple = (), capsys) -> tuple:
    from pitstop.cli import main

    argv = ["prepare", "--workers", "1", "--model", str(model), "--cache-dir", str(cache)]
    for d in data:
        argv += ["--data", str(d)]
    rc = main([*argv, "--json", *extra])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return rc, out, err


def _refused(rc: int, err: str, *needles: str, cache: Path) -> None:
    assert rc == 1, err[-2000:]
    msg = err[err.index("pitstop prepare: error: ") :]
    assert msg.count("\n") == 1, msg  # one paragraph
    for n in needles:
        assert n in msg, msg
    stores = cache / "stores"
    assert not stores.is_dir() or not any(map(is_store, stores.iterdir()))


def _tokens(out: str) -> tuple[list[int], list[int]]:
    s = TokenStore(json.loads(out)["store"])
    return np.asarray(s.tokens).tolist(), np.asarray(s.mask).tolist()


# --- encodings ------------------------------------------------------------------------

LATIN1 = [  # (name, bytes, what the message says): named at the line, as one bad record
    ("l.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n', "l.jsonl:2: invalid UTF-8 at byte 13 of the line; re-encode the file as UTF-8"),
    ("l.csv", b"text\nok\ncaf\xe9\n", "l.csv:3: invalid UTF-8 (byte 3 of the line); re-encode the file as UTF-8"),
    ("l.txt", b"ok\ncaf\xe9 au lait\n", "l.txt: invalid UTF-8 at line 2 of the text; re-encode it as UTF-8"),
    ("l.json", b'[{"text": "caf\xe9"}]', "l.json:1: invalid UTF-8 (byte 14); re-encode the file as UTF-8"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "raw", "needle"), LATIN1, ids=[c[0] for c in LATIN1])
def test_latin1_is_named_at_its_line(name, raw, needle, tiny_model_dir, tmp_path, capsys):
    f = tmp_path / name
    f.write_bytes(raw)
    rc, _, err = _prepare(tiny_model_dir, tmp_path / "c", f, capsys=capsys)
    _refused(rc, err, f"{tmp_path}/{needle}", cache=tmp_path / "c")
    assert f.read_bytes() == raw


def _wide(enc: str, name: str) -> bytes:
    text = _jsonl().decode()
    if name.endswith(".csv"):
        text = "text\n" + "\n".join(r["text"] for r in LINES) + "\n"
    elif name.endswith(".txt"):
        text = LINES[0]["text"]
    return text.encode(enc)


WIDE = [  # (file, encoding written, what the message names)
    ("u16.jsonl", "utf-16", "UTF-16"),
    ("u16.csv", "utf-16", "UTF-16"),
    ("u16.txt", "utf-16", "UTF-16"),
    ("u16be.jsonl", "utf-16-be-bom", "UTF-16"),
    ("u32.jsonl", "utf-32", "UTF-32"),
    ("u16le-nobom.jsonl", "utf-16-le", "UTF-16 (without a byte-order mark)"),
    ("u16.jsonl.gz", "utf-16", "UTF-16"),
]


@pytest.mark.parametrize("skip", [False, True], ids=["error", "skip"])
@pytest.mark.parametrize(("name", "enc", "named"), WIDE, ids=[c[0] for c in WIDE])
def test_utf16_and_utf32_files_are_refused_as_a_whole(
    name, enc, named, skip, tiny_model_dir, tmp_path, capsys
):
    raw = b"\xfe\xff" + _wide("utf-16-be", name) if enc == "utf-16-be-bom" else _wide(enc, name)
    if name.endswith(".gz"):
        raw = gzip.compress(raw)
    f = tmp_path / name
    f.write_bytes(raw)
    extra = ("--on-bad-record", "skip") if skip else ()
    rc, _, err = _prepare(tiny_model_dir, tmp_path / "c", f, extra=extra, capsys=capsys)
    _refused(
        rc, err, f"{f}: the file is encoded as {named}, not UTF-8; re-encode it as UTF-8",
        "iconv -f", cache=tmp_path / "c",
    )  # fmt: skip
    assert "--on-bad-record" not in err  # the file, not a record: skipping does not help


# --- BOM and line ends ----------------------------------------------------------------


def _as(name: str, nl: bytes, bom: bool) -> bytes:
    if name.endswith(".jsonl"):
        raw = _jsonl(nl)
    elif name.endswith(".csv"):
        raw = b"text" + nl + b"".join(b'"' + r["text"].encode() + b'"' + nl for r in LINES)
    elif name.endswith(".json"):
        raw = b"[" + (b"," + nl).join(json.dumps(r).encode() for r in LINES) + b"]" + nl
    else:
        raw = nl.join(r["text"].encode() for r in LINES) + nl
    return (b"\xef\xbb\xbf" if bom else b"") + raw


@pytest.mark.parametrize("name", ["a.jsonl", "a.csv", "a.json", "a.txt"])
@pytest.mark.parametrize(("nl", "bom"), [(b"\r\n", False), (b"\n", True), (b"\r\n", True)],
                         ids=["crlf", "bom", "bom-crlf"])  # fmt: skip
def test_a_bom_and_crlf_give_the_store_of_the_plain_file(
    name, nl, bom, tiny_model_dir, tmp_path, capsys
):
    plain, odd = tmp_path / "plain" / name, tmp_path / "odd" / name
    for f, raw in ((plain, _as(name, b"\n", False)), (odd, _as(name, nl, bom))):
        f.parent.mkdir()
        f.write_bytes(raw)
    rc, out, err = _prepare(tiny_model_dir, tmp_path / "c", odd, capsys=capsys)
    assert rc == 0, err
    got = _tokens(out)
    rc, out, err = _prepare(tiny_model_dir, tmp_path / "c", plain, capsys=capsys)
    want = _tokens(out)
    if name.endswith(".txt") and nl == b"\r\n":
        # A text document is kept as written: its CRs stay, only the BOM goes.
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tiny_model_dir)
        text = _as(name, nl, False).decode()
        assert got[0] == tok(text)["input_ids"] + [tok.eos_token_id]
        assert "\ufeff" not in tok.decode(got[0])
    else:
        assert got == want


def test_a_crlf_corpus_is_cut_at_its_blank_lines(tmp_path, monkeypatch):
    """A text file over TEXT_SPLIT_BYTES is cut at blank lines; with CRLF ends those are
    "\\r\\n\\r\\n" (before: cut inside paragraphs, at the last line end before the limit)."""
    monkeypatch.setattr(readers, "TEXT_SPLIT_BYTES", 2000)
    monkeypatch.setattr(readers, "TEXT_PIECE_BYTES", 400)
    para = "\r\n".join(f"Line {i} of a paragraph, with words." for i in range(6))
    f = tmp_path / "corpus.txt"
    f.write_bytes(("\r\n\r\n".join(para for _ in range(20)) + "\r\n").encode())
    pieces = [raw for c in iter_chunks(f, "text", None, Fields()) for _, raw in c.items]
    assert len(pieces) > 3 and b"".join(pieces) == f.read_bytes()
    for p in pieces[:-1]:
        assert p.endswith(b"\r\n\r\n"), p[-60:]


@pytest.mark.parametrize(
    ("name", "raw", "needle"),
    [
        ("cr.jsonl", b'{"text": "a"}\r{"text": "b"}\r', "cr.jsonl:1: invalid JSON at column 15: Extra data: the lines end in a lone carriage return"),
        ("cr.csv", b"text\rhello\rworld\r", "cr.csv:1: cannot parse the CSV header: the lines end in a lone carriage return"),
    ],
    ids=["jsonl", "csv"],
)  # fmt: skip
def test_lone_cr_line_ends_are_named(name, raw, needle, tiny_model_dir, tmp_path, capsys):
    f = tmp_path / name
    f.write_bytes(raw)
    rc, _, err = _prepare(tiny_model_dir, tmp_path / "c", f, capsys=capsys)
    _refused(rc, err, f"{tmp_path}/{needle}", "tr '\\r' '\\n'", cache=tmp_path / "c")


# --- symbolic links -------------------------------------------------------------------


def test_link_loops_and_dangling_links_are_named(tiny_model_dir, tmp_path, capsys):
    c = tmp_path / "c"
    (tmp_path / "self.jsonl").symlink_to("self.jsonl")
    (tmp_path / "a.jsonl").symlink_to("b.jsonl")
    (tmp_path / "b.jsonl").symlink_to("a.jsonl")
    (tmp_path / "gone.jsonl").symlink_to("nowhere/data.jsonl")
    for name in ("self.jsonl", "a.jsonl"):
        rc, _, err = _prepare(tiny_model_dir, c, tmp_path / name, capsys=capsys)
        _refused(rc, err, f"{tmp_path / name}: a symbolic link loop", "point the link", cache=c)
    rc, _, err = _prepare(tiny_model_dir, c, tmp_path / "gone.jsonl", capsys=capsys)
    _refused(rc, err, "a symbolic link to nowhere/data.jsonl, which does not exist", cache=c)


def test_links_that_lead_somewhere_are_followed(tiny_model_dir, tmp_path, capsys):
    real = tmp_path / "real.jsonl"
    real.write_bytes(_jsonl())
    (tmp_path / "link.jsonl").symlink_to(real)
    rc, out, err = _prepare(tiny_model_dir, tmp_path / "c", tmp_path / "link.jsonl", capsys=capsys)
    assert rc == 0 and json.loads(out)["documents"] == 2, err
    d = tmp_path / "folder"  # a folder holding a loop to itself: a directory, said as such
    d.mkdir()
    (d / "self").symlink_to(".")
    shutil.copy(real, d / "data.jsonl")
    rc, _, err = _prepare(tiny_model_dir, tmp_path / "c2", d, capsys=capsys)
    _refused(rc, err, "is a directory, not a dataset file", "give the data file(s) inside it",
             cache=tmp_path / "c2")  # fmt: skip
    rc, out, err = _prepare(tiny_model_dir, tmp_path / "c3", d / "self" / "self" / "data.jsonl",
                            capsys=capsys)  # fmt: skip
    assert rc == 0 and json.loads(out)["documents"] == 2, err


# --- patterns -------------------------------------------------------------------------


def test_a_pattern_that_matches_nothing_is_named(tiny_model_dir, tmp_path, capsys):
    (tmp_path / "shards").mkdir()
    pattern = f"{tmp_path}/shards/*.jsonl"
    rc, _, err = _prepare(tiny_model_dir, tmp_path / "c", pattern, capsys=capsys)
    _refused(rc, err, f"--data {pattern}: the pattern matches no file", cache=tmp_path / "c")


def test_a_quoted_pattern_reads_its_files_in_order(tiny_model_dir, tmp_path, capsys):
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in (2, 0, 1):
        (shards / f"part-{i}.jsonl").write_text(json.dumps({"text": f"shard number {i}"}) + "\n")
    rc, out, err = _prepare(tiny_model_dir, tmp_path / "c", f"{shards}/part-*.jsonl", capsys=capsys)
    assert rc == 0, err
    s = json.loads(out)
    assert s["documents"] == 3
    manifest = json.loads((Path(s["store"]) / "manifest.json").read_text())
    assert [Path(i["path"]).name for i in manifest["inputs"]] == [
        "part-0.jsonl", "part-1.jsonl", "part-2.jsonl",
    ]  # fmt: skip
    star = tmp_path / "odd*name.jsonl"  # an existing file is itself, not a pattern
    star.write_bytes(_jsonl())
    rc, out, err = _prepare(tiny_model_dir, tmp_path / "c", star, capsys=capsys)
    assert rc == 0 and json.loads(out)["documents"] == 2, err


# --- the tokenizer's own settings ----------------------------------------------------


def test_a_tokenizer_json_that_truncates_or_pads_changes_nothing(tiny_model_dir, tmp_path, capsys):
    """Some tokenizer.json files carry "truncation" or "padding" (for an encoder's 512
    tokens); prepare tokenizes with the backend, which applied them to every document."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    tj = json.loads((model / "tokenizer.json").read_text())
    tj["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst",
                        "stride": 0}  # fmt: skip
    tj["padding"] = {"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None,
                     "pad_id": 2, "pad_type_id": 0, "pad_token": "<pad>"}  # fmt: skip
    (model / "tokenizer.json").write_text(json.dumps(tj))
    data = tmp_path / "d.jsonl"
    data.write_bytes(_jsonl())
    rc, out, err = _prepare(model, tmp_path / "c", data, capsys=capsys)
    assert rc == 0, err
    got = _tokens(out)
    rc, out, err = _prepare(tiny_model_dir, tmp_path / "c", data, capsys=capsys)
    assert got == _tokens(out)


# --- names ----------------------------------------------------------------------------


def test_spaces_and_non_ascii_in_every_path(tiny_model_dir, tmp_path, capsys):
    root = tmp_path / "my data é 数据"
    model = root / "the model ü"
    shutil.copytree(tiny_model_dir, model)
    data = root / "train set ñ.jsonl"
    data.write_bytes(_jsonl())
    cache = root / "cache dir ø"
    rc, out, err = _prepare(model, cache, data, capsys=capsys)
    assert rc == 0, err
    s = json.loads(out)
    assert s["documents"] == 2 and Path(s["store"]).is_relative_to(cache)
    manifest = json.loads((Path(s["store"]) / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["inputs"][0]["path"] == str(data)
    assert manifest["tokenizer"]["path"] == str(model)
    rc, out, err = _prepare(model, cache, data, capsys=capsys)  # the cache finds it again
    assert rc == 0 and json.loads(out)["cache_hit"], err
    bad = root / "bad ñ.jsonl"
    bad.write_bytes(b'{"text": 5}\n')
    rc, _, err = _prepare(model, cache, bad, capsys=capsys)
    assert rc == 1 and f"{bad}:1: field 'text' must be a string" in err


@pytest.mark.skipif(sys.platform == "darwin", reason="macOS file names must be UTF-8")
def test_a_file_name_that_is_not_utf8_is_refused(tiny_model_dir, tmp_path, capsys):
    f = tmp_path / os.fsdecode(b"caf\xe9.jsonl")
    f.write_bytes(_jsonl())
    rc, _, err = _prepare(tiny_model_dir, tmp_path / "c", f, capsys=capsys)
    _refused(rc, err, "caf\\udce9.jsonl: the file name is not valid UTF-8", "rename it",
             cache=tmp_path / "c")  # fmt: skip
    assert f.read_bytes() == _jsonl()


@pytest.mark.slow
def test_the_real_command_on_hostile_files(tiny_model_dir, tmp_path):
    """Through `python -m pitstop`: exit code 1, the message, no traceback."""
    u16 = tmp_path / "u 16.jsonl"
    u16.write_bytes(_jsonl().decode().encode("utf-16"))
    (tmp_path / "loop.jsonl").symlink_to("loop.jsonl")
    for data, needle in [(u16, "encoded as UTF-16"), (tmp_path / "loop.jsonl", "symbolic link loop"),
                         (tmp_path / os.fsdecode(b"\xff.jsonl"), "not valid UTF-8")]:  # fmt: skip
        if not data.exists() and not data.is_symlink():
            data.write_bytes(_jsonl())
        r = subprocess.run(
            [sys.executable, "-m", "pitstop", "prepare", "--model", str(tiny_model_dir),
             "--cache-dir", str(tmp_path / "c"), "--data", str(data)],
            env=env(), capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert r.returncode == 1 and needle in r.stderr, r.stderr[-2000:]
        assert "Traceback" not in r.stderr
