"""The content-addressed token-store cache.

A store lives at `<cache>/stores/<key>/`, where the key hashes everything that
changes the tokens: the bytes of every input file, the tokenizer files (the chat
template is among them), and every option that reaches the tokens. Changing any
of them gives a new key; a repeated prepare finds the store and skips all work.

Hashing a multi-GB file takes seconds, so a file's digest is memoised under
`<cache>/fingerprints/` by (real path, size, mtime_ns): an unchanged file is not
read again, which is what makes a cache hit take well under a second. (An edit
that keeps the size and the nanosecond mtime would go unnoticed, unless
`--recheck-data` is given; no editor or copy tool does that.)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from pitstop.core.atomic import open_regular, read_regular_text, write_cache_entry
from pitstop.core.cache_layout import FINGERPRINTS

PREP_VERSION = 1  # bump when the pipeline changes the tokens it writes for the same inputs
STALE_PARTIAL_SECONDS = 24 * 3600
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".ckpt")
_NOT_TOKENIZER = {"generation_config.json", "pitstop_tiny.json"}


def _digest_file(path: Path) -> str:
    h = hashlib.blake2b(digest_size=20)
    # A FIFO given as data would block the hash forever: refused by name instead.
    fd = open_regular(path, os.O_RDONLY, "an input file", "Give the data as a regular file.")
    with open(fd, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def file_fingerprint(path: str | Path, root: Path, *, recheck: bool = False) -> str:
    """blake2b of the file's bytes, memoised by (realpath, size, mtime_ns).

    `recheck` (`--recheck-data`) hashes the file again whatever the memo says, for a
    file edited in place with its size and modification time kept.
    """
    real = os.path.realpath(path)
    st = os.stat(real)
    memo_key = hashlib.blake2b(f"{real}\0{st.st_size}\0{st.st_mtime_ns}".encode(), digest_size=16)
    memo = root / FINGERPRINTS / memo_key.hexdigest()
    if not recheck:
        try:
            # Not `read_text`: a FIFO planted at a memo's name would block it forever.
            return read_regular_text(memo, "a cached file digest", _remove_fix(memo)).strip()
        except OSError:
            pass
    digest = _digest_file(Path(real))
    write_cache_entry(memo, digest)  # a read-only cache only costs speed
    return digest


def _remove_fix(path: Path) -> str:
    return f"Remove it (rm {path}); the cache rebuilds it."


def tokenizer_fingerprint(tok_dir: str | Path, root: Path) -> str:
    """Hash of every tokenizer-relevant file in the directory (weights excluded)."""
    h = hashlib.blake2b(digest_size=20)
    d = Path(tok_dir)
    for p in sorted(d.iterdir()):
        if not p.is_file() or p.name in _NOT_TOKENIZER or p.suffix in _WEIGHT_SUFFIXES:
            continue
        h.update(p.name.encode() + b"\0" + file_fingerprint(p, root).encode() + b"\0")
    return h.hexdigest()


def store_key(parts: dict[str, Any]) -> str:
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(blob, digest_size=16).hexdigest()


def clean_stale_partials(stores: Path) -> None:
    """Remove `.partial-*` directories left by prepares that were killed long ago.

    Recent ones may belong to a prepare running now, so only those untouched for a
    day go. None of them is ever opened as a store (no manifest at a store's name).
    """
    if not stores.is_dir():
        return
    now = time.time()
    for p in stores.glob("*.partial-*"):
        try:
            newest = max([p.stat().st_mtime] + [c.stat().st_mtime for c in p.iterdir()])
        except OSError:
            continue
        if now - newest > STALE_PARTIAL_SECONDS:
            shutil.rmtree(p, ignore_errors=True)
