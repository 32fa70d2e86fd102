"""Reading input files as a stream of raw-record chunks for the tokenizer workers.

The parent process only splits files into chunks of a bounded size (about
`chunk_bytes` of input each); parsing, validation and tokenization happen in the
workers, so reading stays cheap and memory stays bounded whatever the file size.

Formats, detected from the extension unless `--format` says otherwise:

- JSON Lines (`.jsonl`, `.ndjson`): one record per line. Blank lines, a UTF-8 BOM
  and CRLF line ends are fine. Blocks of whole lines travel to the workers as raw bytes.
- JSON (`.json`): one array of records. The array is parsed whole in the parent
  (the standard library cannot stream it), so use JSON Lines for big data.
- Parquet (`.parquet`, `.pq`): read in row batches of only the record columns.
- CSV (`.csv`): a header row names the fields; streamed row by row.
- Arrow (`.arrow`): the files `datasets` writes (IPC stream, or the IPC file format),
  read in record batches of only the record columns. A stream without its end-of-stream
  marker (or a file without its footer) was cut short, and is refused as truncated.
- A `datasets` directory (`Dataset.save_to_disk` / `DatasetDict.save_to_disk`): its
  `.arrow` files in the order its `state.json` lists them; of a `DatasetDict`, the
  split `--split` names (default `train`; the only split when there is one).
  Read with pyarrow, so the `datasets` package itself is not needed. Every file and
  split these list must lie inside the directory (links followed), each file once.
- Plain text (`.txt`, `.text`, `.md`): **one document per file** — splitting prose
  at blank lines would cut documents into paragraphs and teach the model to end
  text after every paragraph. A file over `TEXT_SPLIT_BYTES` (a corpus dump rather
  than a document) is split at blank lines into documents of about
  `TEXT_PIECE_BYTES`, so memory stays bounded; each piece is then a document.

`.gz` and `.zst` may follow any of the text-based extensions (`data.jsonl.zst`).
Everything wrong with a file as a whole (missing, a directory, empty, not the
format its extension says, a truncated archive) raises `DataError` naming the file
and the fix, whatever `--on-bad-record` says: those are not one bad record.
"""

from __future__ import annotations

import csv
import errno
import gzip
import io
import json
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from pitstop.core.errors import DataError, short_repr
from pitstop.data.records import Fields

TEXT_SPLIT_BYTES = 64 << 20
TEXT_PIECE_BYTES = 4 << 20
CHUNK_BYTES = 1 << 20
# The largest JSONL line (one record) read. Tokenizing costs about 10 bytes of memory per
# byte of text (tokenize.py cuts long texts into pieces), so a record this size needs about
# 1.5 GB; a longer line is skipped unread, never held whole (a 2 GiB line without a newline
# is a broken export, not a document), and reported as a bad record.
MAX_RECORD_BYTES = 128 << 20

EXTENSIONS = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "json",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".arrow": "arrow",
    ".csv": "csv",
    ".txt": "text",
    ".text": "text",
    ".md": "text",
}
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
_MAGIC = {"gzip": b"\x1f\x8b", "zstd": b"\x28\xb5\x2f\xfd"}


@dataclass
class Chunk:
    """A slice of one input file, sent to a worker.

    kind "block": items is [(first line number, raw bytes of whole JSONL lines)]
    kind "lines": items are (line number, raw bytes of one JSONL line)
    kind "rows":  items are (location, decoded record object)
    kind "arrow": items is [(first row number, pyarrow.RecordBatch)]
    kind "text":  items are (location, raw bytes of one document)
    kind "toolong": items are (line number, bytes, ended by a newline) of JSONL lines over
                    MAX_RECORD_BYTES, skipped unread

    `end` is how far into the file as stored (compressed bytes for a compressed file) the
    reader had got when it made this chunk, or None where it cannot tell: it drives
    prepare's progress bar, so it only needs to grow and to reach the file's size by the
    end (prepare counts a file whole once its last chunk is through).
    """

    kind: str
    path: str
    items: list[Any]
    end: int | None = None


def detect(path: Path, fmt: str = "auto") -> tuple[str, str | None]:
    """(format, compression) of `path`; `fmt` other than "auto" overrides the extension."""
    suffixes = [s.lower() for s in path.suffixes]
    compression = COMPRESSIONS.get(suffixes[-1]) if suffixes else None
    if compression:
        suffixes = suffixes[:-1]
    if fmt != "auto":
        return fmt, compression
    ext = suffixes[-1] if suffixes else ""
    if ext not in EXTENSIONS:
        known = ", ".join(sorted(EXTENSIONS))
        raise DataError(
            f"{path}: cannot tell the format from the extension {ext or '(none)'!r}; "
            f"use one of {known} (optionally + .gz/.zst) or pass --format jsonl|json|parquet|csv|text"
        )
    if EXTENSIONS[ext] in ("parquet", "arrow") and compression:
        raise DataError(
            f"{path}: {EXTENSIONS[ext].capitalize()} files are read as they are; "
            f"decompress the {suffixes[-1]} layer first"
        )
    return EXTENSIONS[ext], compression


def is_hf_dataset(path: Path) -> bool:
    """A directory written by `datasets`' save_to_disk (a Dataset or a DatasetDict)."""
    return path.is_dir() and (
        (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()
    )


def _hub_blobs(folder: Path) -> Path | None:
    """The `blobs/` of the Hub-cache repository whose snapshot holds `folder`, if it is one.

    huggingface_hub stores a snapshot's files as links into `REPO/blobs/`, so the data
    files of a dataset downloaded from the Hub resolve there, outside the folder itself.
    """
    parts = folder.absolute().parts
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "snapshots":
            blobs = Path(*parts[:i]) / "blobs"
            return blobs.resolve() if blobs.is_dir() else None
    return None


def _inside(folder: Path, entry: Any, listed: str) -> Path:
    """`folder / entry`, refused unless it lies inside `folder` (links followed).

    A state.json or dataset_dict.json is data, and may come from anyone: a name like
    `../x.arrow`, an absolute path or a link out of the folder must not make pitstop
    read a file the user did not point at.
    """
    if not isinstance(entry, str) or not entry:
        raise TypeError(entry)
    target = folder / entry
    try:
        real = target.resolve()
        allowed = [folder.resolve(), *filter(None, [_hub_blobs(folder)])]
    except (OSError, RuntimeError):  # a link loop
        real, allowed = None, []
    if Path(entry).is_absolute() or ".." in Path(entry).parts:
        why = "a path outside the dataset folder"
    elif real is None:
        why = "a link that cannot be resolved"
    elif not any(real.is_relative_to(a) for a in allowed):
        why = f"a link to {real}, outside the dataset folder"
    else:
        return target
    raise DataError(
        f"{folder}: {listed} {short_repr(entry)}, {why}; everything a dataset lists must "
        "lie inside the dataset folder: save the dataset again with save_to_disk (or copy "
        "its files into the folder)"
    )


def hf_dataset_files(path: Path, split: str = "train") -> tuple[list[Path], str | None]:
    """The .arrow files of a save_to_disk directory, and the split read (None: not a dict).

    A DatasetDict without `split` among its splits is read from its only split, or
    refused with the list of splits when there are several: guessing would train on
    a test set. Every file and split must lie inside the directory, each file once.
    """
    chosen = None
    if (path / "dataset_dict.json").is_file():
        try:
            splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
            if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
                raise TypeError(splits)
        except (OSError, ValueError, KeyError, TypeError):
            raise DataError(
                f"{path}/dataset_dict.json is not readable; save the dataset again with save_to_disk"
            ) from None
        if split in splits:
            chosen = split
        elif len(splits) == 1:
            chosen = splits[0]
        else:
            raise DataError(
                f"{path} is a DatasetDict without a {split!r} split; its splits are "
                f"{', '.join(map(str, splits))}: pass --split NAME"
            )
        path = _inside(path, chosen, "dataset_dict.json lists the split")
    try:
        state = json.loads((path / "state.json").read_text())
        names = [f["filename"] for f in state["_data_files"]]
        files = [_inside(path, name, "state.json lists the data file") for name in names]
    except (OSError, ValueError, KeyError, TypeError):
        raise DataError(
            f"{path}/state.json is missing or not readable, so the order of the .arrow files is "
            "unknown; save the dataset again with save_to_disk"
        ) from None
    if not files:
        raise DataError(f"{path}: the dataset has no data files; give a dataset with records")
    seen: dict[Path, str] = {}
    for name, f in zip(names, files):
        if f.resolve() in seen:
            raise DataError(
                f"{path}: state.json lists the data file {short_repr(name)} twice (as "
                f"{short_repr(seen[f.resolve()])} too), so its records would be read twice; "
                "save the dataset again with save_to_disk"
            )
        seen[f.resolve()] = name
    for f in files:
        if not f.is_file():
            raise DataError(
                f"{f}: listed in {path}/state.json but missing; copy the whole directory"
            )
    return files, chosen


def check_name(path: Path | str, what: str = "file") -> None:
    """Refuse a path whose name is not valid UTF-8 (Linux allows any bytes in a name).

    The path is kept in the store's manifest and the cache's memo, both UTF-8 text.
    """
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        raise DataError(
            f"{ascii(str(path))[1:-1]}: the {what} name is not valid UTF-8 (it was written in "
            "another encoding); rename it, e.g. `convmv -f latin1 -t utf8 --notest NAME`"
        ) from None


def check_file(path: Path) -> None:
    """Refuse what is not a readable data file, each with its own reason and fix."""
    check_name(path)
    if not path.exists():
        if path.is_symlink():
            try:
                path.resolve(strict=True)
            except RuntimeError:  # Python < 3.13
                why = "loop"
            except OSError as e:
                why = "loop" if e.errno == errno.ELOOP else "missing"
            else:
                why = "missing"
            if why == "loop":
                raise DataError(
                    f"{path}: a symbolic link loop (the link leads back to itself); point "
                    "the link at the data file (`ls -l` shows where it goes)"
                )
            raise DataError(
                f"{path}: a symbolic link to {os.readlink(path)}, which does not exist; "
                "fix the link or give the data file itself"
            )
        raise DataError(f"{path}: no such file; check the --data path")
    if path.is_dir():
        raise DataError(
            f"{path} is a directory, not a dataset file (nor a token store: it has no manifest.json); "
            "give the data file(s) inside it"
        )
    if not path.is_file():  # a FIFO, a socket, a device: a read could block or never end
        raise DataError(
            f"{path} is not a regular file (a named pipe, socket or device); write the data "
            "to a file and give that file"
        )
    if path.stat().st_size == 0:
        raise DataError(f"{path}: the file is empty; give a file with records")


class _ZstdReader(io.RawIOBase):
    """Streaming zstd decompression that notices a truncated frame.

    zstandard's own stream_reader ends silently at a truncated frame; a dataset
    quietly missing its tail is worse than an error, so frames are tracked here.
    """

    def __init__(self, raw: BinaryIO) -> None:
        import zstandard

        self._raw = raw
        self._dctx = zstandard.ZstdDecompressor()
        self._obj = self._dctx.decompressobj()
        self._buf = b""
        self._started = False
        self._error = zstandard.ZstdError

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while not self._buf:
            data = self._raw.read(1 << 20)
            if not data:
                if self._started and not self._obj.eof:
                    raise EOFError("zstd stream ended in the middle of a frame")
                return 0
            while data:
                self._started = True
                try:
                    self._buf += self._obj.decompress(data)
                except self._error as e:
                    raise zlib.error(f"zstd: {e}") from None
                if self._obj.eof:  # the next frame, if any, needs a fresh decompressor
                    data = self._obj.unused_data
                    self._obj = self._dctx.decompressobj()
                    self._started = False
                else:
                    data = b""
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n

    def close(self) -> None:
        self._raw.close()
        super().close()


def open_binary(path: Path, compression: str | None) -> BinaryIO:
    """Open `path` for reading, decompressing as its extension says (checked by magic bytes)."""
    f = open(path, "rb")  # noqa: SIM115 - handed to the caller
    if compression is None:
        head = f.read(4)
        f.seek(0)
        # A compressed file under a plain name would otherwise fail as "invalid UTF-8",
        # which sends the user to re-encode a file that only needs renaming.
        for comp, magic in _MAGIC.items():
            if head.startswith(magic):
                f.close()
                ext = ".gz" if comp == "gzip" else ".zst"
                raise DataError(
                    f"{path}: the file is {comp}-compressed but its name does not end in {ext}; "
                    f"rename it to {path.name}{ext}"
                )
        return f
    head = f.read(4)
    f.seek(0)
    if not head.startswith(_MAGIC[compression]):
        f.close()
        ext = path.suffix
        raise DataError(
            f"{path}: the extension says {compression} ({ext}) but the file is not {compression}-"
            f"compressed; decompress it properly or rename it without {ext}"
        )
    if compression == "gzip":
        return gzip.GzipFile(fileobj=f, mode="rb")  # type: ignore[return-value]
    return io.BufferedReader(_ZstdReader(f), buffer_size=1 << 20)  # type: ignore[return-value]


_ARCHIVE_ERRORS = (EOFError, OSError, zlib.error)


def _raw_tell(f: BinaryIO) -> int | None:
    """Bytes of the file on disk read so far through `f` from `open_binary` (read-ahead
    of a decompressor included), or None once it is closed."""
    raw: Any = getattr(f, "fileobj", None)  # gzip.GzipFile's file
    if raw is None:
        raw = getattr(getattr(f, "raw", None), "_raw", f)  # _ZstdReader's file, or f itself
    try:
        return int(raw.tell())
    except (OSError, ValueError):
        return None


def _archive_error(path: Path, e: BaseException, where: str) -> DataError:
    if isinstance(e, EOFError):
        return DataError(
            f"{path}: the compressed file is truncated ({where}); the download or copy was "
            "probably cut short, fetch it again"
        )
    return DataError(f"{path}: the compressed data is corrupt ({where}: {e}); fetch the file again")


def _after(lines: int) -> str:
    """Where reading stopped, as the last whole line read (what the user can check)."""
    if lines == 0:
        return "before the end of line 1"
    return f"after line {lines:,}, the last complete line"


def _read_some(f: BinaryIO, n: int) -> tuple[bytes, BaseException | None]:
    """Up to `n` bytes (fewer only at the end) and the error that ended reading, if any.

    `read(n)` of a truncated archive raises and drops what it had already decompressed
    in that call; `read1` decompresses one piece at a time, so everything before the
    damage is returned and the error can name the last complete line.
    """
    parts: list[bytes] = []
    got = 0
    while got < n:
        try:
            piece = f.read1(min(n - got, CHUNK_BYTES))  # type: ignore[attr-defined]
        except _ARCHIVE_ERRORS as e:
            return b"".join(parts), e
        if not piece:
            break
        parts.append(piece)
        got += len(piece)
    return b"".join(parts), None


def iter_chunks(
    path: Path, fmt: str, compression: str | None, fields: Fields, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[Chunk]:
    """Chunks of raw records of one file, in file order."""
    check_file(path)
    reader = {
        "jsonl": _jsonl,
        "json": _json,
        "parquet": _parquet,
        "arrow": _arrow,
        "csv": _csv,
        "text": _text,
    }[fmt]
    if fmt in ("jsonl", "json", "csv", "text"):
        _check_encoding(path, compression)
    n = 0
    for chunk in reader(path, compression, fields, chunk_bytes):
        n += len(chunk.items)
        yield chunk
    if n == 0:
        raise DataError(f"{path}: no records found (only blank lines?); give a file with records")


_WIDE_BOMS = (  # UTF-32 first: its little-endian mark starts with UTF-16's
    (b"\xff\xfe\x00\x00", "UTF-32"),
    (b"\x00\x00\xfe\xff", "UTF-32"),
    (b"\xff\xfe", "UTF-16"),
    (b"\xfe\xff", "UTF-16"),
)


def _check_encoding(path: Path, compression: str | None) -> None:
    """Refuse a UTF-16 or UTF-32 file as a whole, naming the encoding and the fix.

    Read as UTF-8, every line of such a file is a bad record ("invalid UTF-8 at byte 0",
    or a NUL byte), which sends the user hunting for one broken line, and with
    --on-bad-record skip it ends as "no usable documents". The byte-order mark says what
    the file is; without one, NUL bytes at every other position of ASCII text do.
    """
    with open_binary(path, compression) as f:
        head, _ = _read_some(f, 64)
    name = next((enc for bom, enc in _WIDE_BOMS if head.startswith(bom)), None)
    if name is None and len(head) >= 8:
        even, odd = bool(head[0::2].strip(b"\x00")), bool(head[1::2].strip(b"\x00"))
        if even != odd:  # one of the two byte positions is always NUL
            name = "UTF-16 (without a byte-order mark)"
    if name:
        raise DataError(
            f"{path}: the file is encoded as {name}, not UTF-8; re-encode it as UTF-8, "
            f"e.g. `iconv -f {name.split()[0]} -t UTF-8 IN > OUT`"
        )


def _jsonl(
    path: Path, compression: str | None, fields: Fields, chunk_bytes: int
) -> Iterator[Chunk]:
    # Whole blocks of lines travel to the workers, which split them: the parent then does
    # one read, one newline count and one memcpy-like pickle per block, and stays out of
    # the workers' way (splitting into per-line objects here cost a third of a core).
    # A line longer than a block is gathered in pieces and joined once (re-joining at
    # every read was quadratic), up to MAX_RECORD_BYTES; past that the rest of the line is
    # read and dropped, so memory stays bounded whatever the line, and the worker reports it.
    limit = MAX_RECORD_BYTES
    lineno = 1
    parts: list[bytes] = []  # the line being gathered, not yet ended by a newline
    held = 0  # its bytes so far
    skipped: int | None = None  # bytes so far of an over-long line being dropped
    first = True
    with open_binary(path, compression) as f:
        while True:
            data, err = _read_some(f, chunk_bytes)
            if err is not None:  # lines before the damage were read whole; the rest is lost
                raise _archive_error(path, err, _after(lineno - 1 + data.count(b"\n"))) from None
            if first and data.startswith(b"\xef\xbb\xbf"):
                data = data[3:]
            first = False
            if not data:
                break
            if skipped is not None:
                nl = data.find(b"\n")
                if nl < 0:
                    skipped += len(data)
                    continue
                yield Chunk("toolong", str(path), [(lineno, skipped + nl, True)], _raw_tell(f))
                lineno += 1
                skipped, data = None, data[nl + 1 :]
            cut = data.rfind(b"\n") + 1
            if cut == 0:  # no line ends in this read: keep gathering
                parts.append(data)
                held += len(data)
                if held > limit:
                    skipped, parts, held = held, [], 0
                continue
            if parts:  # the first newline here ends the line gathered so far
                nl = data.find(b"\n")
                if held + nl > limit:
                    yield Chunk("toolong", str(path), [(lineno, held + nl, True)], _raw_tell(f))
                    lineno += 1
                    data, cut = data[nl + 1 :], cut - nl - 1
                else:
                    parts.append(data)
                    data, cut = b"".join(parts), cut + held
                parts, held = [], 0
            block, rest = data[:cut], data[cut:]
            if rest:
                parts, held = [rest], len(rest)
            if block.strip():
                yield Chunk("block", str(path), [(lineno, block)], _raw_tell(f))
            lineno += block.count(b"\n")
    if skipped is not None:
        yield Chunk("toolong", str(path), [(lineno, skipped, False)])
    elif parts:  # the last line, without a newline
        block = b"".join(parts)
        if block.strip():
            yield Chunk("block", str(path), [(lineno, block)])


def _read_text(path: Path, compression: str | None) -> str:
    with open_binary(path, compression) as f:
        raw, err = _read_some(f, 1 << 62)
    if err is not None:
        raise _archive_error(path, err, _after(raw.count(b"\n"))) from None
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise DataError(
            f"{path}:{line}: invalid UTF-8 (byte {e.start}); re-encode the file as UTF-8"
        ) from None


def _json(path: Path, compression: str | None, fields: Fields, chunk_bytes: int) -> Iterator[Chunk]:
    text = _read_text(path, compression)
    try:
        data = json.loads(text)
    except RecursionError:  # hostile nesting must be a DataError, not a traceback
        raise DataError(
            f"{path}: invalid JSON: nested too deeply for a dataset; fix the file"
        ) from None
    except ValueError as e:
        hint = "fix the syntax"
        if getattr(e, "msg", "") == "Extra data":
            hint = "it looks like JSON Lines (one record per line): rename it to .jsonl or pass --format jsonl"
        raise DataError(
            f"{path}:{getattr(e, 'lineno', '?')}: invalid JSON at column {getattr(e, 'colno', '?')} "
            f"({getattr(e, 'msg', e)}); {hint}"
        ) from None
    if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), list):
        data = next(iter(data.values()))  # {"data": [...]} is a common wrapper
    if not isinstance(data, list):
        raise DataError(
            f"{path}: a .json file must hold an array of records, got a {type(data).__name__}; "
            "use JSON Lines (.jsonl) for one record per line"
        )
    del text
    size = path.stat().st_size
    per_chunk = 1024
    for start in range(0, len(data), per_chunk):
        items = [
            (f"record {i + 1}", data[i]) for i in range(start, min(start + per_chunk, len(data)))
        ]
        yield Chunk("rows", str(path), items, size * (start + len(items)) // len(data))


def _parquet(
    path: Path, compression: str | None, fields: Fields, chunk_bytes: int
) -> Iterator[Chunk]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(
            f"{path}: not a readable Parquet file ({e}); check the file or pass the right --format"
        ) from None
    names = pf.schema_arrow.names
    columns = [c for c in dict.fromkeys(fields.all()) if c in names]
    if not columns:
        raise DataError(
            f"{path}: none of the record columns are present: found columns {names}; "
            f"expected {fields.expected()}"
        )
    meta = pf.metadata
    row_bytes = max(
        1,
        sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
        // max(1, meta.num_rows),
    )
    batch_rows = max(16, min(65536, chunk_bytes // row_bytes))
    size, rows = path.stat().st_size, max(1, meta.num_rows)  # the footer knows the row count
    row = 1
    try:
        for batch in pf.iter_batches(batch_size=batch_rows, columns=columns):
            end = size * min(rows, row - 1 + batch.num_rows) // rows
            yield Chunk("arrow", str(path), [(row, batch)], end)
            row += batch.num_rows
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: row {row}: the Parquet data is damaged ({e})") from None


_ARROW_FILE_MAGIC = b"ARROW1"
_ARROW_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # continuation marker + zero length
_ARROW_LEGACY_EOS = b"\x00\x00\x00\x00"  # streams written before Arrow 0.15
_REWRITE = "the write or copy was cut short: write the file again (or copy it whole)"


def _arrow_stream_end(path: Path, source: Any) -> None:
    """Refuse an IPC stream that does not end with its end-of-stream marker.

    pyarrow's stream reader takes the end of the bytes for the end of the data, so a
    stream cut at a record-batch boundary would read as a complete, shorter dataset.
    The messages are walked here (metadata only; bodies are slices of the memory map)
    to find where the last whole message ends: what follows must be the marker.
    """
    import pyarrow as pa

    reader = pa.ipc.MessageReader.open_stream(source)
    end, batches, damage = 0, 0, None
    while True:
        try:
            message = reader.read_next_message()
        except StopIteration:
            break
        except (pa.ArrowException, OSError) as e:
            if end == 0:  # not one whole message: not an Arrow stream at all (said by the caller)
                raise
            damage = e
            break
        end = source.tell()
        batches += message.type == "record batch"
    if end == 0:  # no message at all: open_stream says what the file is not
        return
    source.seek(end)
    tail = source.read(8)
    if damage is None and (tail.startswith(_ARROW_EOS) or tail.startswith(_ARROW_LEGACY_EOS)):
        return
    source.seek(0)
    try:  # the whole messages before the cut read as a stream of their own
        rows = sum(b.num_rows for b in pa.ipc.open_stream(pa.py_buffer(source.read(end))))
        done = f"{batches:,} record batch{'es' * (batches != 1)} ({rows:,} rows)"
    except (pa.ArrowException, OSError):
        done = f"{batches:,} record batch{'es' * (batches != 1)}"
    if damage is None:
        raise DataError(f"{path}: truncated: no end-of-stream marker after {done}; {_REWRITE}")
    raise DataError(
        f"{path}: truncated or damaged: the stream breaks off after {done}, inside the "
        f"next message ({damage}); {_REWRITE}"
    )


def _arrow(
    path: Path, compression: str | None, fields: Fields, chunk_bytes: int
) -> Iterator[Chunk]:
    import pyarrow as pa

    # datasets writes the IPC stream format; other tools write the IPC file format, which
    # starts (and, when complete, ends) with the magic bytes ARROW1.
    try:
        source = pa.memory_map(str(path), "r")
        if source.read(6) != _ARROW_FILE_MAGIC:
            source.seek(0)
            _arrow_stream_end(path, source)
            source.seek(0)
            batches: Any = pa.ipc.open_stream(source)
            schema = batches.schema
            n_batches = 0  # the stream's position says how far it got
        else:
            source.seek(0)
            try:
                ipc_file = pa.ipc.open_file(source)
            except pa.ArrowInvalid:
                if source.size() < 12 or source.read_at(6, source.size() - 6) != _ARROW_FILE_MAGIC:
                    raise DataError(
                        f"{path}: truncated: an Arrow IPC file without its footer; {_REWRITE}"
                    ) from None
                raise
            batches = (ipc_file.get_batch(i) for i in range(ipc_file.num_record_batches))
            schema, n_batches = None, ipc_file.num_record_batches
    except (pa.ArrowException, OSError) as e:
        raise DataError(
            f"{path}: not a readable Arrow file ({e}); check the file or pass the right --format"
        ) from None
    size = source.size()
    row, before = 1, 0
    try:
        for i, batch in enumerate(batches):
            # Bytes read: the stream's position, or (IPC file) the share of its batches.
            after = size * (i + 1) // n_batches if n_batches else source.tell()
            if schema is None:
                schema = batch.schema
            names = schema.names
            columns = [c for c in dict.fromkeys(fields.all()) if c in names]
            if not columns:
                raise DataError(
                    f"{path}: none of the record columns are present: found columns {names}; "
                    f"expected {fields.expected()}"
                )
            batch = batch.select(columns)
            # Slices of about chunk_bytes, so one huge record batch still spreads over workers.
            per_row = max(1, batch.nbytes // max(1, batch.num_rows))
            step = max(16, chunk_bytes // per_row)
            for start in range(0, batch.num_rows, step):
                piece = batch.slice(start, step)
                done = min(batch.num_rows, start + step) / max(1, batch.num_rows)
                yield Chunk(
                    "arrow", str(path), [(row, piece)], before + int((after - before) * done)
                )
                row += piece.num_rows
            before = after
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: row {row}: the Arrow data is damaged ({e})") from None


def _csv_problem(e: Exception, what: str = "row") -> str:
    msg = str(e)
    if "new-line character seen in unquoted field" in msg:
        # Python's hint (universal-newline mode) is for programmers; the user has a file
        # whose lines end in a lone CR, which only classic Mac OS wrote.
        return (
            f"cannot parse the CSV {what}: the lines end in a lone carriage return (CR, "
            "classic Mac OS line ends); convert them to LF or CRLF, e.g. `tr '\\r' '\\n'`"
        )
    if "field larger than field limit" in msg:
        return (
            f"a CSV field is over {MAX_RECORD_BYTES / 2**20:,.0f} MiB, the limit of one record "
            "(its tokens would take gigabytes to compute); split it into several records"
        )
    return f"cannot parse the CSV {what} ({msg})"


def _csv(path: Path, compression: str | None, fields: Fields, chunk_bytes: int) -> Iterator[Chunk]:
    csv.field_size_limit(MAX_RECORD_BYTES)
    lineno = 0

    def lines(f: BinaryIO) -> Iterator[str]:
        nonlocal lineno
        for lineno, raw in enumerate(f, 1):
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{path}:{lineno}: invalid UTF-8 (byte {e.start} of the line); re-encode the file as UTF-8"
                ) from None

    with open_binary(path, compression) as f:
        try:
            reader = csv.reader(lines(f), strict=True)
            try:
                header = next(reader)
            except StopIteration:
                return
            except csv.Error as e:
                raise DataError(f"{path}:1: {_csv_problem(e, 'header')}") from None
            if not any(c in header for c in fields.all()):
                raise DataError(
                    f"{path}:1: the CSV header names none of the record fields: found {header}; "
                    f"expected {fields.expected()}"
                )
            items: list[tuple[str, Any]] = []
            size = 0
            while True:
                start = lineno + 1
                try:
                    row = next(reader)
                except StopIteration:
                    break
                except csv.Error as e:
                    raise DataError(f"{path}:{start}: {_csv_problem(e)}") from None
                if not any(cell.strip() for cell in row):
                    continue
                if len(row) != len(header):
                    rec: Any = {"__csv_columns__": (len(row), len(header))}
                else:
                    rec = {h: v for h, v in zip(header, row) if h in fields.all()}
                items.append((str(start), rec))
                size += sum(len(c) for c in row)
                if size >= chunk_bytes:
                    yield Chunk("rows", str(path), items, _raw_tell(f))
                    items, size = [], 0
        except _ARCHIVE_ERRORS as e:  # lines are read whole, so `lineno` was the last one
            raise _archive_error(path, e, _after(lineno)) from None
    if items:
        yield Chunk("rows", str(path), items)


def _text(path: Path, compression: str | None, fields: Fields, chunk_bytes: int) -> Iterator[Chunk]:
    with open_binary(path, compression) as f:
        buf, err = _read_some(f, TEXT_SPLIT_BYTES + 1)
        if err is not None:
            raise _archive_error(path, err, _after(buf.count(b"\n"))) from None
        if len(buf) <= TEXT_SPLIT_BYTES:
            yield Chunk("text", str(path), [(None, buf)], _raw_tell(f))
            return
        # A corpus dump, not a document: pieces of about TEXT_PIECE_BYTES cut at blank lines.
        eof, line, span = False, 1, 2 * TEXT_PIECE_BYTES
        while buf or not eof:
            if not eof and len(buf) < span:
                more, err = _read_some(f, TEXT_PIECE_BYTES)
                if err is not None:
                    lines = line - 1 + (buf + more).count(b"\n")
                    raise _archive_error(path, err, _after(lines)) from None
                eof = not more
                buf += more
                continue
            if len(buf) <= span:
                cut = len(buf)
            else:
                # A blank line: "\n\n", or "\r\n\r\n" in a file with Windows line ends.
                lf, crlf = buf.rfind(b"\n\n", 0, span), buf.rfind(b"\n\r\n", 0, span)
                cut = max(lf + 2 if lf >= 0 else 0, crlf + 3 if crlf >= 0 else 0)
                if cut < 2:
                    cut = buf.rfind(b"\n", 0, span) + 1
                if cut < 1:
                    cut = span
                    while cut > 0 and (buf[cut] & 0xC0) == 0x80:  # not inside a UTF-8 character
                        cut -= 1
            piece, buf = buf[:cut], buf[cut:]
            if piece.strip():
                yield Chunk("text", str(path), [(line, piece)], _raw_tell(f))
            line += piece.count(b"\n")
