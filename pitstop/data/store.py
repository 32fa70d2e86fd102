"""The token store: a prepared dataset as flat, memory-mappable arrays.

Layout of a store directory (all little-endian, no pickles)::

    manifest.json   format version, dtype, counts, largest token id, a CRC-32 checksum
                    of each array file, inputs, tokenizer, options, statistics
    tokens.bin      every sequence's token ids back to back (uint16 if the vocabulary fits, else uint32)
    mask.bin        uint8 per token: 1 where the token is a loss target, 0 where it is context only
    offsets.bin     int64 [n_sequences + 1]: sequence i is tokens[offsets[i]:offsets[i+1]]
    doc_ids.bin     int64 [n_sequences]: the source document of each sequence (split chunks share it)
    seq_lengths.bin, seq_trained.bin
                    uint32 [n_sequences]: each sequence's tokens and trained targets, counted
                    while writing (pitstop.data.facts; a store written before them gets
                    them counted once and cached beside it)

A *sequence* is at most `max_seq_len` tokens: documents longer than that were split
into consecutive chunks (or truncated or dropped) at prepare time, so batching only
ever arranges sequences. A document's first token never carries loss (nothing
before it in the document predicts it); `mask` marks targets only.

Atomicity: a writer fills `<dest>.partial-<pid>-<random>/`, writes the manifest last,
fsyncs, and renames the directory into place. A directory without a manifest, or
whose files do not match the manifest's counts, is never opened as a store.

Integrity: the checksums are computed while the arrays are written (no second pass) and
checked when a store is first opened in a process, so damage to a store, even damage
that keeps every id in range, is refused by name instead of trained on. A training run
checks the token and mask arrays on a thread while it loads its model and plans (they are
most of the bytes: ~3 s of reading at 10M documents), and waits for the verdict before its
first batch (`TokenStore.verified()`). CRC-32 because
it is the fastest check zlib offers (a few times blake2b's speed) and it catches
accidental damage; it is no defence against someone who can also edit the manifest,
and nothing stored beside the data could be. Stores written before checksums existed
open unchecked, and their largest token id is found by one scan.

Written by hand because no library offers a streaming, append-only, memory-mappable
token array with a loss mask; numpy's memmap does the reading.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import shutil
import threading
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pitstop.catalog.model_config import ModelConfig
from pitstop.core.atomic import fsync_dir
from pitstop.core.errors import DataError
from pitstop.data.facts import FACT_DTYPE, FACT_FILES, LENGTHS_FILE, TRAINED_FILE, chunk_trained

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
FILES = ("tokens.bin", "mask.bin", "offsets.bin", "doc_ids.bin")
# What a writer writes: the arrays, then the per-sequence facts (optional when reading).
WRITTEN = FILES + FACT_FILES
# Tokens summed per pass when counting targets per sequence: 8 MiB of mask, a 64 MiB sum.
TARGET_SPAN = 1 << 23


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 halves the store (and reading time) whenever every id fits."""
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


def is_store(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of the token store in directory `path`, without opening its arrays
    (DataError saying what to do when it is missing or damaged)."""
    store, mpath = Path(path), Path(path) / MANIFEST
    if not mpath.is_file():
        raise DataError(
            f"{store} is not a pitstop token store (no {MANIFEST}); "
            "give a dataset file or run `pitstop prepare` first"
        )
    try:
        return json.loads(mpath.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{mpath} is damaged ({e}); delete {store} and prepare again") from None


class StoreWriter:
    """Appends sequences to a store being built; `finish()` publishes it atomically."""

    def __init__(self, dest: str | Path, vocab_size: int) -> None:
        self.dest = Path(dest)
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        # The pid tells a later prepare whether this directory's writer is still alive.
        self.tmp = (
            self.dest.parent / f"{self.dest.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
        )
        self.tmp.mkdir()
        self.dtype = token_dtype(vocab_size)
        self._files = {name: open(self.tmp / name, "wb") for name in WRITTEN}  # noqa: SIM115
        self._crc = dict.fromkeys(WRITTEN, 0)
        self.n_tokens = 0
        self.n_sequences = 0
        self.max_token_id = -1
        self._write("offsets.bin", np.zeros(1, dtype=np.int64).tobytes())

    def _write(self, name: str, data: bytes) -> None:
        self._files[name].write(data)
        self._crc[name] = zlib.crc32(data, self._crc[name])

    def append(
        self,
        tokens: np.ndarray,
        mask: np.ndarray,
        lengths: Sequence[int] | np.ndarray,
        doc_ids: Sequence[int] | np.ndarray,
    ) -> None:
        """Append sequences given as one flat token array split by `lengths`."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != len(tokens) or len(tokens) != len(mask):
            raise ValueError("tokens, mask and lengths disagree")  # a bug, not user error
        tokens = np.asarray(tokens, dtype=self.dtype)
        if len(tokens):
            self.max_token_id = max(self.max_token_id, int(tokens.max()))
        self._write("tokens.bin", tokens.tobytes())
        self._write("mask.bin", np.asarray(mask, dtype=np.uint8).tobytes())
        ends = self.n_tokens + np.cumsum(lengths)
        self._write("offsets.bin", ends.astype(np.int64).tobytes())
        self._write("doc_ids.bin", np.asarray(doc_ids, dtype=np.int64).tobytes())
        self._write(LENGTHS_FILE, lengths.astype(FACT_DTYPE).tobytes())
        self._write(TRAINED_FILE, chunk_trained(mask, lengths).tobytes())
        self.n_tokens += int(lengths.sum())
        self.n_sequences += len(lengths)

    def finish(self, manifest: dict[str, Any]) -> Path:
        for f in self._files.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        manifest = {
            **manifest,
            "format_version": FORMAT_VERSION,
            "dtype": self.dtype.name,
            "n_tokens": self.n_tokens,
            "n_sequences": self.n_sequences,
            "max_token_id": self.max_token_id,
            "checksums": {name: _crc_text(c) for name, c in self._crc.items()},
        }
        with open(self.tmp / MANIFEST, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if self.dest.exists():  # a concurrent prepare of the same key finished first
            shutil.rmtree(self.tmp, ignore_errors=True)
            return self.dest
        try:
            os.replace(self.tmp, self.dest)
        except OSError as e:
            # Another prepare of the same key published between the check and the rename
            # (ENOTEMPTY/EEXIST): its store is the same content; this copy is not needed.
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not is_store(self.dest):
                raise
            shutil.rmtree(self.tmp, ignore_errors=True)
            return self.dest
        fsync_dir(self.dest.parent)
        return self.dest

    def abort(self) -> None:
        # On a full disk the first close flushes and fails with ENOSPC again: every file is
        # closed regardless, so the partial store is always removed (it would keep the disk
        # full after a failed prepare that says nothing was added).
        for f in self._files.values():
            with contextlib.suppress(OSError):
                f.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is not None:
            self.abort()


class TokenStore:
    """Read-only view of a finished store; arrays are memory-mapped, nothing is loaded eagerly."""

    def __init__(self, path: str | Path, *, verify: bool | str = True) -> None:
        """Open a store; `verify` reads every array once per process to check its checksum
        (prepare's cache lookup skips it to stay instant; training never does).

        `verify="background"` checks the small arrays now and the token and mask arrays
        (3 bytes or more per token: ~3.5 GB at 10M documents) on a thread, while the run
        loads its model and plans; `verified()` waits for it and raises what it found, and
        the loader calls it before its first batch, so nothing trains on damaged data."""
        self.path = Path(path)
        self.manifest: dict[str, Any] = read_manifest(self.path)
        if self.manifest.get("format_version") != FORMAT_VERSION:
            raise DataError(
                f"{self.path} was written by another pitstop version "
                f"(store format {self.manifest.get('format_version')}, this one reads {FORMAT_VERSION}); "
                "prepare the data again"
            )
        self.dtype = np.dtype(self.manifest["dtype"])
        n_tok, n_seq = int(self.manifest["n_tokens"]), int(self.manifest["n_sequences"])
        expected = {
            "tokens.bin": n_tok * self.dtype.itemsize,
            "mask.bin": n_tok,
            "offsets.bin": (n_seq + 1) * 8,
            "doc_ids.bin": n_seq * 8,
        }
        checksums = self.manifest.get("checksums")
        # Fact files the manifest names must be whole; a store without them gets them
        # counted (pitstop.data.facts.sequence_facts).
        for name in FACT_FILES:
            if isinstance(checksums, dict) and name in checksums:
                expected[name] = n_seq * FACT_DTYPE.itemsize
        for name, size in expected.items():
            p = self.path / name
            actual = p.stat().st_size if p.is_file() else None
            if actual != size:
                has = "is missing" if actual is None else f"has {actual:,} bytes"
                raise DataError(
                    f"{p} {has}, the manifest says {size:,} bytes: the store is incomplete "
                    f"or damaged; delete {self.path} and prepare again"
                )
        self._check: _BackgroundCheck | None = None
        if verify == "background":
            _verify_checksums(self.path, checksums, skip=BULK)
            self._check = _BackgroundCheck(self.path, checksums)
        elif verify:
            _verify_checksums(self.path, checksums)
        self.tokens = _memmap(self.path / "tokens.bin", self.dtype, n_tok)
        self.mask = _memmap(self.path / "mask.bin", np.uint8, n_tok)
        self.offsets = _memmap(self.path / "offsets.bin", np.int64, n_seq + 1)
        self.doc_ids = _memmap(self.path / "doc_ids.bin", np.int64, n_seq)

    def verified(self) -> None:
        """Wait for a background checksum check (verify="background"); raise its DataError."""
        if self._check is not None:
            self._check.result()

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        """Length of every sequence, int64 [n_sequences]."""
        return np.diff(np.asarray(self.offsets))

    @property
    def max_seq_len(self) -> int:
        return int(self.manifest["max_seq_len"])

    @property
    def n_tokens(self) -> int:
        return int(self.manifest["n_tokens"])

    @property
    def max_token_id(self) -> int:
        """The largest token id in the store (-1 when empty); older stores: one scan."""
        if "max_token_id" not in self.manifest:
            self.manifest["max_token_id"] = int(self.tokens.max()) if len(self.tokens) else -1
        return int(self.manifest["max_token_id"])

    @property
    def pad_id(self) -> int:
        """The id batches pad with. Padding never reaches the loss or a real token's
        attention, so any valid id works: the tokenizer's pad, else its EOS, else 0."""
        m = self.manifest
        for key in ("pad_token_id", "pad_id", "eos_token_id", "eos_id"):
            v = m.get(key)
            if v is None and isinstance(m.get("tokenizer"), dict):
                v = m["tokenizer"].get(key)
            if isinstance(v, int):
                return v
        return 0

    def sequence(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(token ids as int64, loss mask as bool) of sequence i."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[a:b].astype(np.int64), self.mask[a:b].astype(bool)

    def eos_only_documents(self) -> dict[str, Any] | None:
        """How many documents carry no loss target but their last token (the EOS):
        {"count", "of" (documents held), "by_kind"}, from the manifest's statistics.

        A store prepared before prepare recorded it: found from the loss mask when the
        store holds no more targets than documents (every document EOS-only needs that;
        then the scan keeps one int64 per target), else None: some document then holds a
        real target, and the exact count is not worth a pass that keeps every target.
        """
        info = (self.manifest.get("stats") or {}).get("eos_only_documents")
        if isinstance(info, dict) and isinstance(info.get("count"), int):
            return info
        doc_ids = np.asarray(self.doc_ids)
        held = int(np.count_nonzero(np.diff(doc_ids))) + 1 if len(doc_ids) else 0
        if int(np.count_nonzero(self.mask)) > held:
            return None
        _, free = target_free_documents(np.asarray(self.mask), np.asarray(self.offsets), doc_ids)
        count = int(free.sum())
        kinds = (self.manifest.get("stats") or {}).get("record_kinds")
        if count == held and isinstance(kinds, dict) and sum(kinds.values()) == held:
            return {"count": count, "of": held, "by_kind": kinds}  # all of them, so each shape
        return {"count": count, "of": held, "by_kind": {}}

    def target_counts(self) -> np.ndarray:
        """Loss-carrying tokens per sequence, int64 [n_sequences].

        Summed over spans of at most TARGET_SPAN tokens (whole sequences), so the memory is
        8 bytes per sequence plus one span's running sum, whatever the store's size (one
        cumulative sum over the whole mask cost 16 bytes per token: 3.3 GB at 206M tokens).
        """
        off = np.asarray(self.offsets, dtype=np.int64)
        n = len(off) - 1
        out = np.empty(max(n, 0), dtype=np.int64)
        i = 0
        while i < n:
            # The sequences [i, j) that fit in one span (at least one, however long).
            j = int(np.searchsorted(off, off[i] + TARGET_SPAN, side="right")) - 1
            j = min(n, max(j, i + 1))
            a = int(off[i])
            csum = np.zeros(int(off[j]) - a + 1, dtype=np.int64)
            np.cumsum(self.mask[a : int(off[j])], dtype=np.int64, out=csum[1:])
            out[i:j] = csum[off[i + 1 : j + 1] - a] - csum[off[i:j] - a]
            i = j
        return out


def target_free_documents(
    mask: np.ndarray, offsets: np.ndarray, doc_ids: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(the documents held, bool: which of them carry no loss target but their last token).

    The arrays are a store's (or one prepare chunk's): a document's sequences are
    consecutive, so each document is one span of tokens, and a target inside the span
    that is not its last token (the EOS that ends every document) is something to learn.
    A document with no target at all counts as target-free too. Memory: a few numbers
    per document (one int64 per target cost one huge record 16 bytes per token).
    """
    n = len(doc_ids)
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)
    doc_ids = np.asarray(doc_ids)
    first = np.flatnonzero(np.r_[True, doc_ids[1:] != doc_ids[:-1]])
    last = np.r_[first[1:] - 1, n - 1]
    offsets = np.asarray(offsets, dtype=np.int64)
    doc_start, doc_end = offsets[first], offsets[last + 1] - 1
    mask = np.asarray(mask)
    if mask.dtype != bool:
        mask = mask.view(bool) if mask.dtype.itemsize == 1 else mask != 0  # 0/1 bytes
    # Any target in [start, end) of each document, its last token left out: reduceat over
    # interleaved (start, end) runs; the odd runs fall between documents. A one-token
    # document's run is empty, which reduceat would answer with that token: no target.
    bounds = np.column_stack([doc_start, doc_end]).ravel()
    real = np.logical_or.reduceat(mask, bounds)[0::2] & (doc_end > doc_start)
    return doc_ids[first], ~real


def check_vocab(store: TokenStore, model_dir: str | Path | None) -> None:
    """Refuse a model whose embedding cannot look up every id the store holds.

    An id at or past the embedding's size fails mid-step with an IndexError (on CUDA a
    device-side assert that kills the process), so it is checked before training: the
    store's largest id and the size of the tokenizer that wrote it, against the
    model's `vocab_size` (the rows of its input embedding in Hugging Face models).
    """
    rows = _embedding_rows(model_dir)
    if rows is None:
        return  # no config.json vocab_size to check against; the model load reports that
    tok = store.manifest.get("tokenizer") or {}
    tok_size = tok.get("vocab_size")
    problems = []
    if store.max_token_id >= rows:
        problems.append(
            f"the token store {store.path} holds token id {store.max_token_id}, but the model "
            f"in {model_dir} has an embedding of {rows} rows (ids 0-{rows - 1})"
        )
    if isinstance(tok_size, int) and tok_size > rows:
        problems.append(
            f"the tokenizer that prepared {store.path} ({tok.get('path', '?')}) has {tok_size} "
            f"tokens, more than the model's {rows} embedding rows"
        )
    if problems:
        raise DataError(
            "; ".join(problems) + ". Prepare the data with this model's own tokenizer "
            "(--tokenizer defaults to --model), or resize the model's embedding to the "
            "tokenizer (model.resize_token_embeddings(len(tokenizer))) and save the model"
        )


def _embedding_rows(model_dir: str | Path | None) -> int | None:
    config = ModelConfig.read_optional(model_dir)
    return config.vocab_size if config is not None else None


def _crc_text(crc: int) -> str:
    return f"crc32:{crc:08x}"


# Files already verified in this process, by identity: a store is often opened twice
# (prepare's cache lookup, then training), and reading it once is enough.
_VERIFIED: set[tuple[str, int, int, int, int]] = set()


def _file_id(p: Path) -> tuple[str, int, int, int, int]:
    st = p.stat()  # any write changes ctime, which no tool can set back
    return (os.path.realpath(p), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


# The arrays of a token each: what a background check reads (the rest are per sequence).
BULK = ("tokens.bin", "mask.bin")


class _BackgroundCheck:
    """`_verify_checksums` of the bulk arrays on a daemon thread (zlib.crc32 and file reads
    release the GIL, so it overlaps the run's start-up on another core). Not a
    ThreadPoolExecutor future: its thread is joined at interpreter exit, so a run refused
    before its first batch would first read gigabytes it no longer needs."""

    def __init__(self, path: Path, checksums: Any) -> None:
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(path, checksums), name="pitstop-store-check", daemon=True
        )
        self._thread.start()

    def _run(self, path: Path, checksums: Any) -> None:
        try:
            _verify_checksums(path, checksums, only=BULK)
        except BaseException as e:  # handed to the thread that waits in result()
            self._error = e

    def result(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


def _verify_checksums(
    path: Path, checksums: Any, *, only: Sequence[str] = (), skip: Sequence[str] = ()
) -> None:
    """Read each array file once per process and compare its checksum with the manifest
    (`only` / `skip`: those files only / not those)."""
    if not isinstance(checksums, dict):
        return  # written before checksums existed: opened unchecked (see the module doc)
    for name in FILES + tuple(n for n in FACT_FILES if n in checksums):
        if (only and name not in only) or name in skip:
            continue
        p = path / name
        ident = _file_id(p)
        if ident in _VERIFIED:
            continue
        crc = 0
        with open(p, "rb") as f:
            while block := f.read(1 << 22):
                crc = zlib.crc32(block, crc)
        if _crc_text(crc) != checksums.get(name):
            raise DataError(
                f"{p} does not match the checksum in its manifest: the store was changed or "
                f"damaged after it was written; delete {path} and prepare the data again"
            )
        _VERIFIED.add(ident)


def _memmap(path: Path, dtype: Any, n: int) -> np.ndarray:
    if n == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(n,))
