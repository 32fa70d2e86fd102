"""Every truncated or corrupt .gz / .zst input is refused, naming the last complete line.

The archive is cut at every byte offset (and, for gzip and checksummed zstd, damaged at
every byte of its body): reading must end in a DataError, never in a store of whatever
happened to decompress, and a truncation names the last line read whole, the same number
that a plain decompressor recovers from the cut file.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from pathlib import Path

import pytest
import zstandard

from pitstop.core.config import RunConfig
from pitstop.core.errors import DataError
from pitstop.data.readers import iter_chunks
from pitstop.data.records import Fields

LINES = b"".join(
    json.dumps({"text": f"record {i} " + "abcdefghij"[i % 10] * (i % 37)}).encode() + b"\n"
    for i in range(60)
)
FIELDS = Fields.from_config(RunConfig())


def _read_all(path: Path, fmt: str, comp: str) -> int:
    """Lines read (JSON Lines), in blocks of about 256 bytes so a cut falls between blocks."""
    chunks = iter_chunks(path, fmt, comp, FIELDS, chunk_bytes=256)
    return sum(block.count(b"\n") for c in chunks for _, block in c.items)


def _recoverable_lines(raw: bytes, comp: str) -> int:
    """Complete lines a streaming decompressor gets out of a cut archive."""
    if comp == "gzip":
        return zlib.decompressobj(wbits=31).decompress(raw).count(b"\n")
    out = zstandard.ZstdDecompressor().decompressobj().decompress(raw) if len(raw) > 4 else b""
    return out.count(b"\n")


def _named_line(message: str) -> int:
    if "before the end of line 1" in message:
        return 0
    m = re.search(r"after line ([\d,]+), the last complete line", message)
    assert m, message
    return int(m.group(1).replace(",", ""))


ARCHIVES = {
    "gzip": ("t.jsonl.gz", gzip.compress(LINES)),
    "zstd": ("t.jsonl.zst", zstandard.ZstdCompressor().compress(LINES)),
}


@pytest.mark.parametrize("comp", ["gzip", "zstd"])
def test_every_cut_is_refused_with_the_last_complete_line(comp, tmp_path):
    name, full = ARCHIVES[comp]
    f = tmp_path / name
    for cut in range(4, len(full)):  # below 4 bytes the magic check refuses it by name
        f.write_bytes(full[:cut])
        with pytest.raises(DataError) as e:
            _read_all(f, "jsonl", comp)
        msg = e.value.render()
        assert "the compressed file is truncated" in msg, (cut, msg)
        assert _named_line(msg) == _recoverable_lines(full[:cut], comp), (cut, msg)
    f.write_bytes(full)
    assert _read_all(f, "jsonl", comp) == 60  # the whole file reads


def test_the_issue_case_names_a_real_line(tmp_path, tiny_model_dir, capsys):
    """200 short records cut to their first 300 compressed bytes: refused, and not "line 1"."""
    from pitstop.cli import main

    raw = b"".join(
        json.dumps({"text": f"the quick brown fox {i}"}).encode() + b"\n" for i in range(200)
    )
    gz = gzip.compress(raw)
    assert len(gz) > 300
    f = tmp_path / "cut.jsonl.gz"
    f.write_bytes(gz[:300])
    rc = main(["prepare", "--model", str(tiny_model_dir), "--data", str(f),
               "--cache-dir", str(tmp_path / "c"), "--workers", "1"])  # fmt: skip
    err = capsys.readouterr().err
    expected = _recoverable_lines(gz[:300], "gzip")
    assert rc == 1 and f"after line {expected}, the last complete line" in err, err
    assert expected > 1 and "Traceback" not in err
    assert not list((tmp_path / "c" / "stores").glob("*/manifest.json"))  # no store published


@pytest.mark.parametrize(
    ("comp", "name", "data"),
    [
        ("gzip", "t.jsonl.gz", gzip.compress(LINES)),
        ("zstd", "t.jsonl.zst", zstandard.ZstdCompressor(write_checksum=True).compress(LINES)),
    ],
)
def test_every_damaged_byte_is_refused(comp, name, data, tmp_path):
    """A flipped byte anywhere after the header: an error, never different records."""
    f = tmp_path / name
    header = 10 if comp == "gzip" else 6  # gzip's mtime/flags bytes and zstd's frame header
    for i in range(header, len(data)):
        bad = bytearray(data)
        bad[i] ^= 0x55
        f.write_bytes(bytes(bad))
        with pytest.raises(DataError, match=r"compressed (data is corrupt|file is truncated)"):
            _read_all(f, "jsonl", comp)


@pytest.mark.parametrize(("fmt", "name"), [("csv", "t.csv.gz"), ("text", "t.txt.gz"), ("json", "t.json.gz")])  # fmt: skip
def test_other_formats_name_the_last_complete_line(fmt, name, tmp_path):
    body = {
        "csv": b"text\n" + b"".join(b"row %d\n" % i for i in range(300)),
        "text": b"".join(b"line %d of prose\n" % i for i in range(300)),
        "json": b"[\n" + b",\n".join(b'{"text": "r%d"}' % i for i in range(300)) + b"\n]\n",
    }[fmt]
    gz = gzip.compress(body)
    f = tmp_path / name
    f.write_bytes(gz[: len(gz) // 2])
    with pytest.raises(DataError) as e:
        for _ in iter_chunks(f, fmt, "gzip", FIELDS, chunk_bytes=256):
            pass
    expected = _recoverable_lines(gz[: len(gz) // 2], "gzip")
    assert expected > 10 and _named_line(e.value.render()) == expected, e.value.render()
