"""prepare's progress bar counts input bytes against the files' total size, so it has an ETA.

The total is the sum of the input files' sizes as stored (compressed bytes for .gz/.zst),
known before reading; the bar advances as the readers get through each file
(`Chunk.end`) and reaches the total exactly when the last chunk is written, on the
single-process path and through the worker pool alike. No pass counts the records first.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import ClassVar

import pytest
import tqdm as tqdm_module

from pitstop.core.config import RunConfig
from pitstop.core.corpus import sample_texts
from pitstop.data import prepare as prep
from pitstop.data.readers import detect, iter_chunks
from pitstop.data.records import Fields


class _Recorder(tqdm_module.tqdm):
    """A tqdm that keeps its total, every position it was moved to, and its last postfix."""

    made: ClassVar[list[_Recorder]] = []

    def __init__(self, *a, **k):
        k["disable"] = False  # record even where stderr is no terminal
        super().__init__(*a, **k)
        self.positions: list[int] = []
        self.postfixes: list[str] = []
        _Recorder.made.append(self)

    def update(self, n=1):
        out = super().update(n)
        self.positions.append(self.n)
        return out

    def set_postfix_str(self, s="", refresh=True):
        self.postfixes.append(s)
        return super().set_postfix_str(s, refresh)


def _inputs(d: Path) -> list[Path]:
    """One file of each format the bar has to follow, a few chunks each at 4 KB chunks."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    texts = sample_texts(40)
    lines = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    (d / "a.jsonl").write_bytes(lines)
    (d / "b.jsonl.gz").write_bytes(gzip.compress(lines))
    (d / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    table = pa.table({"text": texts})
    pq.write_table(table, d / "d.parquet", row_group_size=10)
    # An IPC stream (as `datasets` writes) and the IPC file format.
    for name, new in (("e.arrow", pa.ipc.new_stream), ("f.arrow", pa.ipc.new_file)):
        with pa.OSFile(str(d / name), "wb") as f, new(f, table.schema) as w:
            for b in table.to_batches(max_chunksize=10):
                w.write_batch(b)
    (d / "g.json").write_text(json.dumps([{"text": t} for t in texts[:5]]))
    (d / "h.csv").write_text("text\n" + "".join(json.dumps(t) + "\n" for t in texts[:20]))
    (d / "i.txt").write_text(texts[0])
    return sorted(d.iterdir())


@pytest.mark.parametrize("workers", [1, 2], ids=["one-process", "pool"])
def test_bar_total_is_the_input_bytes_and_the_bar_reaches_it(
    workers, tmp_path, tiny_model_dir, cache_dir, monkeypatch
):
    (tmp_path / "in").mkdir()
    files = _inputs(tmp_path / "in")
    total = sum(p.stat().st_size for p in files)
    monkeypatch.setattr(prep, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(tqdm_module, "tqdm", _Recorder)
    opened: list[str] = []
    real = prep.iter_chunks

    def counting(path, *a, **k):
        opened.append(Path(path).name)
        return real(path, *a, **k)

    monkeypatch.setattr(prep, "iter_chunks", counting)
    _Recorder.made = []
    cfg = RunConfig(
        data=[str(p) for p in files],
        model=str(tiny_model_dir),
        cache_dir=str(cache_dir),
        workers=workers,
    )
    p = prep.prepare_data(cfg, progress=True)
    (bar,) = _Recorder.made
    assert bar.total == total and bar.unit == "B"
    assert bar.n == total == bar.positions[-1]  # 100% at the end, not before the last write
    assert bar.positions == sorted(bar.positions)  # never moves back
    # Mid-file positions, not only whole files: the big JSONL alone moves it several times.
    inside = [n for n in bar.positions if 0 < n < files[0].stat().st_size]
    assert len(inside) >= 3, bar.positions
    assert len(set(bar.positions)) > len(files), bar.positions
    # Records and tokens/s still show, and the records are all of them.
    records = p.stats["records_read"]
    assert bar.postfixes[-1].startswith(f"{records:,} rec, ") and bar.postfixes[-1].endswith(
        " tok/s"
    )
    assert sorted(opened) == [
        f.name for f in files
    ]  # each file's records read once: no counting pass


@pytest.mark.parametrize(
    "name", ["a.jsonl", "b.jsonl.gz", "d.parquet", "e.arrow", "f.arrow", "h.csv"]
)
def test_chunk_ends_grow_within_the_file(name, tmp_path):
    _inputs(tmp_path)
    path = tmp_path / name
    fmt, comp = detect(path)
    ends = [c.end for c in iter_chunks(path, fmt, comp, Fields(), chunk_bytes=2048)]
    size = path.stat().st_size
    assert len(ends) >= 3 and None not in ends
    assert ends == sorted(ends) and 0 < ends[0] < size and ends[-1] <= size, ends


def test_zstd_chunk_ends_follow_its_raw_reads(tmp_path):
    """The zstd reader pulls 1 MiB of compressed bytes at a time, so its chunks' ends move
    in steps of that: a 3 MB file still shows progress inside it."""
    import os

    import zstandard

    lines = b"".join(b'{"text": "%s"}\n' % os.urandom(3000).hex().encode() for _ in range(1000))
    path = tmp_path / "big.jsonl.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(lines))
    size = path.stat().st_size
    assert size > 3_000_000
    ends = [c.end for c in iter_chunks(path, "jsonl", "zstd", Fields(), chunk_bytes=1 << 18)]
    assert None not in ends and ends == sorted(ends) and ends[-1] <= size
    assert len({e for e in ends if e < size}) >= 2, ends
