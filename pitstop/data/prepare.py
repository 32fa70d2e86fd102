"""`prepare_data`: dataset files -> a cached token store, in parallel and in bounded memory.

The parent process streams raw record chunks from the readers to tokenizer processes
through a bounded window of futures (`data/pool.py`) and writes the returned arrays to the
store in input order. The statistics keep how many documents and sequences have each
length (`data.stats.LengthCounts`), so memory does not grow with the size of the input.
The progress bar counts input bytes against the files' total size (known before reading),
so it shows an ETA; each chunk carries how far into its file the reader had got
(`Chunk.end`), and while the pool waits for a chunk the bar keeps showing the records per
second.

The store is written to a temporary directory and renamed into place under its
content key (see cache.py), so a killed prepare leaves nothing that opens as a
store, and a repeated one is a cache hit. An interrupted prepare is not resumed part
way: the same command again prepares from the start. A partial directory whose writer is
gone (its pid, in the name, dead; its lock free) is removed by the next prepare into the
cache, saying so (`_claim`, `_leftovers`).
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from pitstop.core import log
from pitstop.core.cache_layout import STORES, cache_root
from pitstop.core.config import DEFAULT_MAX_RECORD_SECONDS, RunConfig
from pitstop.core.errors import ConfigError, DataError
from pitstop.core.faults import NO_FAULTS, Faults, from_env
from pitstop.core.positions import position_limit
from pitstop.core.runlock import pid_alive
from pitstop.data import tokenize
from pitstop.data.cache import (
    PREP_VERSION,
    clean_stale_partials,
    file_fingerprint,
    store_key,
    tokenizer_fingerprint,
)
from pitstop.data.pool import in_order
from pitstop.data.readers import (
    CHUNK_BYTES,
    Chunk,
    check_file,
    check_name,
    detect,
    hf_dataset_files,
    is_hf_dataset,
    iter_chunks,
)
from pitstop.data.records import Fields
from pitstop.data.stats import LengthCounts, compute_stats, format_stats
from pitstop.data.store import FORMAT_VERSION, StoreWriter, TokenStore, is_store, token_dtype
from pitstop.data.tokenize import (
    MAX_BAD_EXAMPLES,
    ChunkResult,
    Settings,
    Worker,
    load_tokenizer,
)

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no flock; leftovers then go after a day
    fcntl = None  # type: ignore[assignment]

__all__ = ["Prepared", "expand_patterns", "format_stats", "open_store", "prepare_data"]


@dataclass
class Prepared:
    """Where the store is, whether it came from the cache, its statistics, and the time taken."""

    store_path: Path
    cache_hit: bool
    stats: dict
    seconds: float


def prepare_data(
    cfg: RunConfig, *, data: list[str] | None = None, progress: bool = True
) -> Prepared:
    """Tokenize `data` (default `cfg.data`) into a token store in the cache, or find it there.

    A single existing token store directory is returned as is.
    """
    t0 = time.perf_counter()
    inputs = expand_patterns(list(cfg.data if data is None else data))
    if not inputs:
        raise ConfigError("no data: give --data FILE (a dataset file or a prepared token store)")
    if len(inputs) == 1 and is_store(inputs[0]):
        store = TokenStore(inputs[0], verify=False)  # open_store verifies what trains
        return Prepared(
            Path(inputs[0]), True, store.manifest.get("stats", {}), time.perf_counter() - t0
        )
    job = _job(cfg, inputs, progress)
    hit = _cached(job.dest, t0)
    if hit is not None:
        return hit
    clean_stale_partials(job.stores)
    _leftovers(job.stores, job.key, progress)
    return _build(cfg, job, progress, t0)


class InputInfo(TypedDict):
    """One input file as the manifest records it (and the store key hashes)."""

    path: str
    fingerprint: str
    format: str
    compression: str | None
    bytes: int


@dataclass
class _Job:
    """What one prepare reads, with what, and the cache key of the store it makes."""

    paths: list[Path]
    formats: list[tuple[str, str | None]]  # (format, compression) of each path
    fields: Fields
    tok_dir: str
    options: dict[str, Any]
    input_info: list[InputInfo]
    tok_info: dict[str, Any]
    key: str
    stores: Path

    @property
    def dest(self) -> Path:
        return self.stores / self.key

    @property
    def sizes(self) -> list[int]:
        return [int(i["bytes"]) for i in self.input_info]


def _job(cfg: RunConfig, inputs: list[str], progress: bool) -> _Job:
    """Check the inputs and the tokenizer, fingerprint them, and key the store."""
    for d in inputs:
        if is_store(d):
            raise DataError(
                f"{d} is a token store; a store can only be given alone, not with other --data"
            )
    tok_dir = _tokenizer_dir(cfg)
    paths, formats = _sources(cfg, inputs, progress)
    check_name(tok_dir, "tokenizer directory")
    root = cache_root(cfg.cache_dir)
    check_name(root, "cache directory")
    root.mkdir(parents=True, exist_ok=True)
    fields = Fields.from_config(cfg)
    options = {
        "fields": fields.__dict__,
        "template": cfg.template,
        "max_seq_len": cfg.max_seq_len,
        "long_docs": cfg.long_docs,
        "train_on_prompt": cfg.train_on_prompt,
        "on_bad_record": cfg.on_bad_record,
    }
    # A record skipped for its rendering time is missing from the store, so a prepare that
    # gives records more (or unlimited) time must not be served that store: another limit
    # is another key. The default stays out of the key, so the stores prepared before the
    # limit existed keep theirs (and a run that skipped nothing writes the same bytes).
    if cfg.max_record_seconds != DEFAULT_MAX_RECORD_SECONDS:
        options["max_record_seconds"] = cfg.max_record_seconds
    input_info = [
        {
            "path": str(p),
            "fingerprint": file_fingerprint(p, root, recheck=cfg.recheck_data),
            "format": f,
            "compression": c,
            "bytes": p.stat().st_size,
        }
        for p, (f, c) in zip(paths, formats)
    ]
    tok_info = {"path": str(tok_dir), "fingerprint": tokenizer_fingerprint(tok_dir, root)}
    key = store_key(
        {
            "inputs": [(i["fingerprint"], i["format"], i["compression"]) for i in input_info],
            "tokenizer": tok_info["fingerprint"],
            "options": options,
            "store_format": FORMAT_VERSION,
            "prepare_version": PREP_VERSION,
        }
    )
    return _Job(paths, formats, fields, tok_dir, options, input_info, tok_info, key, root / STORES)


def _tokenizer_dir(cfg: RunConfig) -> str:
    tok_dir = cfg.tokenizer or cfg.model
    if not tok_dir:
        raise ConfigError("no tokenizer: give --model DIR or --tokenizer DIR")
    if not Path(tok_dir).is_dir():
        from pitstop.core.hub import missing_hint

        raise ConfigError(
            f"tokenizer directory {tok_dir} does not exist; give a local Hugging Face directory"
            + missing_hint(str(tok_dir))
        )
    return tok_dir


def _sources(
    cfg: RunConfig, inputs: list[str], progress: bool
) -> tuple[list[Path], list[tuple[str, str | None]]]:
    """The files to read (a dataset folder's among them) and each one's format."""
    paths: list[Path] = []
    formats: list[tuple[str, str | None]] = []
    for d in map(Path, inputs):
        if is_hf_dataset(d):
            files, split = hf_dataset_files(d, cfg.split)
            if split is not None and progress:
                print(f"reading split {split!r} of the DatasetDict {d}")
            paths += files
            formats += [("arrow", None)] * len(files)
            continue
        check_file(d)
        paths.append(d)
        formats.append(detect(d, cfg.format))
    for p in paths:  # a dataset folder's files too: their names go into the manifest
        check_name(p)
    return paths, formats


def _cached(dest: Path, t0: float) -> Prepared | None:
    """The store already in the cache under this key, or None."""
    if not is_store(dest):
        return None
    try:
        store = TokenStore(dest, verify=False)  # a cache hit stays instant
        return Prepared(dest, True, store.manifest.get("stats", {}), time.perf_counter() - t0)
    except DataError:
        shutil.rmtree(dest, ignore_errors=True)  # damaged by hand; rebuild it
        return None


def _build(cfg: RunConfig, job: _Job, progress: bool, t0: float) -> Prepared:
    """Tokenize every input into a new store and publish it under the job's key."""
    tok = load_tokenizer(job.tok_dir, cfg.trust_remote_code)
    vocab = len(tok)
    job.tok_info.update(
        class_name=type(tok).__name__,
        vocab_size=vocab,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
        chat_template=bool(tok.chat_template),
    )
    settings = Settings(
        tokenizer=str(job.tok_dir),
        trust_remote_code=cfg.trust_remote_code,
        fields=job.fields,
        template=cfg.template,
        max_seq_len=cfg.max_seq_len,
        long_docs=cfg.long_docs,
        train_on_prompt=cfg.train_on_prompt,
        skip_bad=cfg.on_bad_record == "skip",
        token_dtype=token_dtype(vocab).name,
        max_record_seconds=cfg.max_record_seconds,
    )
    with StoreWriter(job.dest, vocab) as writer, _claim(writer.tmp):
        stats = _tokenize_into(writer, cfg, job, settings, tok, progress, t0)
        manifest = {
            "key": job.key,
            "max_seq_len": cfg.max_seq_len,
            "inputs": job.input_info,
            "tokenizer": job.tok_info,
            "options": job.options,
            "prepare_version": PREP_VERSION,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "stats": stats,
        }
        writer.finish(manifest)
    return Prepared(job.dest, False, stats, time.perf_counter() - t0)


def _tokenize_into(
    writer: StoreWriter,
    cfg: RunConfig,
    job: _Job,
    settings: Settings,
    tok: Any,
    progress: bool,
    t0: float,
) -> dict[str, Any]:
    """Every input's chunks tokenized (in this process, or by a pool of `cfg.workers`) and
    appended to `writer` in input order; returns the statistics."""
    workers = cfg.workers or os.cpu_count() or 1
    sizes = job.sizes
    fault = from_env()  # tests stop a prepare at a named point (docs/fault-injection.md)

    def chunks() -> Iterator[tuple[int, Chunk]]:
        base = 0
        for p, (fmt, comp), size in zip(job.paths, job.formats, sizes):
            yield from _with_bytes_read(
                iter_chunks(p, fmt, comp, job.fields, CHUNK_BYTES), base, size
            )
            base += size

    if workers <= 1:
        worker = Worker(settings, tok)
        results: Iterable[tuple[int, ChunkResult | None]] = (
            (done, worker.process(c)) for done, c in chunks()
        )
        return _write(results, writer, cfg, progress, t0, sum(sizes), fault)
    tokenize._WORKER = Worker(settings, tok)  # forked workers inherit it, loaded once
    gen = in_order(chunks(), settings, workers)
    try:
        return _write(gen, writer, cfg, progress, t0, sum(sizes), fault)
    finally:
        gen.close()


def expand_patterns(inputs: list[str]) -> list[str]:
    """`--data` entries with a quoted pattern (`'shards/*.jsonl'`) replaced by its files, sorted.

    An entry that exists is taken as it is, even with `*` in its name. A pattern that
    matches nothing is refused here, naming the pattern: as a missing file it would read
    "no such file", which sends the user looking for a file named with a `*`.
    """
    out: list[str] = []
    for d in map(str, inputs):
        if os.path.lexists(d) or not any(c in d for c in "*?["):
            out.append(d)
            continue
        found = sorted(glob.glob(d, recursive=True))
        if not found:
            raise DataError(
                f"--data {d}: the pattern matches no file; check the directory and the "
                "pattern (pitstop expands a quoted pattern itself; the shell passes an "
                "unquoted one on as it is when nothing matches)"
            )
        out += found
    return out


def open_store(
    cfg: RunConfig, data: list[str] | None = None, *, progress: bool = True
) -> TokenStore:
    """Prepare `data` through the cache, then open the store. Its token and mask arrays
    are checked against their checksums on a thread (`TokenStore.verified()` waits; the
    loader does before its first batch)."""
    return TokenStore(
        prepare_data(cfg, data=data, progress=progress).store_path, verify="background"
    )


# A partial directory younger than this whose writer's pid is alive may be a prepare's
# that has made it and not yet locked it (the two are a few system calls apart), so it is
# not taken for a killed one.
_CLAIM_GRACE_SECONDS = 30
# The lock fds this process holds on partial directories: a forked tokenizer worker closes
# its copies (`_drop_claims`), so the lock goes the moment the prepare itself dies, not
# when its workers notice (`tokenize._exit_with_parent`, up to half a second later).
_CLAIMS: set[int] = set()


def _drop_claims() -> None:
    for fd in list(_CLAIMS):
        with contextlib.suppress(OSError):
            os.close(fd)  # the parent's descriptor keeps the lock
    _CLAIMS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_claims)


@contextlib.contextmanager
def _claim(tmp: Path) -> Iterator[None]:
    """Hold an exclusive flock on the partial directory `tmp` while this prepare writes it.

    The kernel drops the lock when the process dies, however it dies (SIGKILL too), so a
    later prepare can tell a killed prepare's directory from a running one's. Forked
    processes close their copy of the descriptor (`_drop_claims`). Where flock is not
    available nothing is claimed, and `_leftovers` then removes nothing.
    """
    if fcntl is None:
        yield
        return
    try:
        fd = os.open(tmp, os.O_RDONLY)
    except OSError:
        yield
        return
    _CLAIMS.add(fd)
    try:
        # Blocking: only another prepare's probe (`_leftovers`) can hold it, for an instant.
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        _CLAIMS.discard(fd)
        os.close(fd)


def _leftovers(stores: Path, key: str, progress: bool) -> None:
    """Remove the partial stores (`*.partial-*`) whose prepares are gone, and say so.

    A directory goes when its lock is free (no prepare holds it) and its writer is gone:
    the pid in its name (`<key>.partial-<pid>-<hex>`, `StoreWriter`) is no live process,
    or, for a name without one (or a live pid that may be another process's now), it is
    older than `_CLAIM_GRACE_SECONDS`. One of another store is removed only on the pid's
    word. A held one belongs to a prepare running now, which this one does not wait for
    (the first to finish publishes the store).
    """
    if fcntl is None:
        return
    for p in sorted(stores.glob("*.partial-*")):
        mine = p.name.startswith(f"{key}.partial-")
        try:
            held = _held(p)
            dead = _writer_dead(p)
            gone = not held and (
                dead or (mine and time.time() - p.stat().st_mtime >= _CLAIM_GRACE_SECONDS)
            )
            size = sum(f.stat().st_size for f in p.iterdir() if f.is_file()) if gone else 0
        except OSError:
            continue
        if gone:
            shutil.rmtree(p, ignore_errors=True)
        if not progress or not (mine or gone):
            continue
        if not gone:
            log.info(
                f"another prepare of the same data is running (or was stopped seconds ago): "
                f"{p}; this one prepares too, and the first to finish publishes the store"
            )
        elif mine:
            log.info(
                f"an earlier prepare of this data was interrupted after writing "
                f"{size / 2**20:,.1f} MiB; it is not resumed part way: removed {p.name} "
                "and preparing from the start"
            )
        else:
            log.info(
                f"removed {p.name} ({size / 2**20:,.1f} MiB), the partial store of an "
                "interrupted prepare of other data"
            )


def _held(p: Path) -> bool:
    """Whether a prepare holds the lock on partial directory `p` (probed for an instant)."""
    fd = os.open(p, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _writer_dead(p: Path) -> bool:
    """Whether the pid in partial directory `p`'s name is no live process on this machine."""
    m = re.fullmatch(r"(\d+)-[0-9a-f]+", p.name.rsplit(".partial-", 1)[1])
    return m is not None and int(m.group(1)) != os.getpid() and not pid_alive(int(m.group(1)))


def _with_bytes_read(chunks: Iterator[Chunk], base: int, size: int) -> Iterator[tuple[int, Chunk]]:
    """Each chunk of one file with the input bytes read once it is through: `base` (the
    files before) plus how far into this file its reader had got, `size` after the last.

    One chunk is held back to know which is the last, so the bar reaches its total
    exactly when the last chunk is written (a reader's position may lag behind the end).
    """
    done, held = base, None
    for c in chunks:
        if held is not None:
            yield done, held
        if c.end is not None:
            done = max(done, base + min(size, c.end))
        held = c
    if held is not None:
        yield base + size, held


class _Tally:
    """What the written chunks add up to: counts per length (memory flat in the number of
    documents), record and token counts, and the first bad records as examples."""

    def __init__(self) -> None:
        self.doc_lens, self.seq_lens = LengthCounts(), LengthCounts()
        self.bad_examples: list[dict[str, str]] = []
        self.slow_examples: list[dict[str, str]] = []
        self.kinds: dict[str, int] = {}
        self.eos_only: dict[str, int] = {}
        self.c = dict.fromkeys(("docs_held", "records", "bad", "slow", *_SUMMED), 0)
        self.doc_base = 0  # documents written so far: the next chunk's first document id
        self.chunks = 0

    def add(self, res: ChunkResult) -> None:
        """Count one chunk's result (its arrays are already written)."""
        self.doc_base += len(res["doc_len"])
        self.doc_lens.add(res["doc_len"])
        self.seq_lens.add(res["seq_len"])
        self.c["records"] += res["n_records"]
        self.c["bad"] += res["n_bad"]
        for k in _SUMMED:
            self.c[k] += res[k]
        for k, v in res["kinds"].items():
            self.kinds[k] = self.kinds.get(k, 0) + v
        self.c["docs_held"] += res["docs_held"]
        for k, v in res["eos_only"].items():
            self.eos_only[k] = self.eos_only.get(k, 0) + v
        for where, reason in res["bad"]:
            if len(self.bad_examples) < MAX_BAD_EXAMPLES:
                self.bad_examples.append({"where": where, "reason": reason})
        self.c["slow"] += res["n_slow"]
        for where, what in res["slow"]:
            if len(self.slow_examples) < MAX_BAD_EXAMPLES:
                self.slow_examples.append({"where": where, "what": what})


# A chunk result's counts that are summed as they are.
_SUMMED = ("targets", "long", "extra_chunks", "targets_lost", "tokens_removed", "targets_removed")


def _check(res: ChunkResult) -> None:
    """Stop on a worker's crash, or on a bad record unless bad records are skipped."""
    if "crash" in res:
        raise RuntimeError("a tokenizer worker failed unexpectedly:\n" + res["crash"])
    if res.get("fatal"):
        where, reason = res["bad"][0]
        raise DataError(
            f"{where}: {reason} (to skip such records instead, pass --on-bad-record skip)"
        )


def _bar(total_bytes: int, progress: bool) -> Any:
    """Input bytes against the known total, so tqdm shows an ETA; records and tokens/s
    ride in the postfix."""
    from tqdm import tqdm

    return tqdm(
        total=total_bytes,
        unit="B",
        unit_scale=True,  # k, M, G of 1000: "MB/s" is then what it says
        file=sys.stderr,
        disable=not progress or not log.progress_enabled(),
        desc="prepare",
        dynamic_ncols=True,
    )


def _write(
    results: Iterable[tuple[int, ChunkResult | None]],
    writer: StoreWriter,
    cfg: RunConfig,
    progress: bool,
    t0: float,
    total_bytes: int,
    fault: Faults = NO_FAULTS,
) -> dict[str, Any]:
    """Append each chunk's arrays to the store in order, counting as it goes; returns the
    statistics. A result of None (`pool.WAITING`) only refreshes the bar's rates."""
    tally = _Tally()
    bar = _bar(total_bytes, progress)
    rate = _Rate()
    try:
        for done, res in results:
            if res is None:
                bar.set_postfix_str(_postfix(tally, rate, writer, t0))
                continue
            _check(res)
            writer.append(
                res["tokens"], res["mask"], res["seq_len"], res["seq_doc"] + tally.doc_base
            )
            tally.add(res)
            bar.set_postfix_str(_postfix(tally, rate, writer, t0), refresh=False)
            bar.update(done - bar.n)
            tally.chunks += 1
            fault.reached("prepare-chunk", tally.chunks)
    finally:
        bar.close()
    return _stats(tally, writer, cfg, t0)


class _Rate:
    """Records per second over about the last `window` seconds: it falls to 0 while nothing
    comes back (an average since the start would hide a stall behind the minutes before)."""

    def __init__(self, window: float = 10.0) -> None:
        self.window = window
        self.samples: deque[tuple[float, int]] = deque([(time.perf_counter(), 0)])

    def __call__(self, records: int) -> float:
        now = time.perf_counter()
        self.samples.append((now, records))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window:
            self.samples.popleft()  # keep the newest sample that is `window` old
        then, before = self.samples[0]
        return (records - before) / max(now - then, 1e-9)


def _postfix(tally: _Tally, rate: _Rate, writer: StoreWriter, t0: float) -> str:
    n = tally.c["records"]
    per_s = rate(n)
    dt = max(time.perf_counter() - t0, 1e-9)
    return (
        f"{n:,} rec, {per_s:,.{1 if per_s < 10 else 0}f} rec/s, {writer.n_tokens / dt:,.0f} tok/s"
    )


def _nothing_usable(tally: _Tally, cfg: RunConfig) -> DataError:
    c, bad, slow = tally.c, tally.bad_examples, tally.slow_examples
    if slow and not bad:
        return DataError(
            f"no usable documents: all {c['records']} records took over "
            f"{cfg.max_record_seconds:g} s to render (first: {slow[0]['where']}: "
            f"{slow[0]['what']}); pass a larger --max-record-seconds, or 0 for no limit"
        )
    if bad:
        what = "bad or too slow to render" if slow else "bad"
        return DataError(
            f"no usable documents: all {c['records']} records were {what} "
            f"(first: {bad[0]['where']}: {bad[0]['reason']})"
        )
    return DataError("no usable documents in the input")


def _stats(tally: _Tally, writer: StoreWriter, cfg: RunConfig, t0: float) -> dict[str, Any]:
    """The store's statistics (the manifest's and `pitstop prepare`'s table)."""
    c, bad_examples = tally.c, tally.bad_examples
    if tally.doc_base == 0:
        raise _nothing_usable(tally, cfg)
    seconds = time.perf_counter() - t0
    counts = {
        "documents": tally.doc_base,
        "sequences": writer.n_sequences,
        "tokens": writer.n_tokens,
        "target_tokens": c["targets"],
        "records_read": c["records"],
        "record_kinds": tally.kinds,
        "bad_records": c["bad"],
        "bad_examples": bad_examples,
        "slow_records": {
            "limit_seconds": cfg.max_record_seconds,
            "count": c["slow"],
            "examples": tally.slow_examples,
        },
        # Documents whose only target is their EOS: checked by `train` (docs/data.md).
        "eos_only_documents": {
            "count": sum(tally.eos_only.values()),
            "of": c["docs_held"],
            "by_kind": tally.eos_only,
        },
        "long_documents": {
            "policy": cfg.long_docs,
            "count": c["long"],
            "extra_chunks": c["extra_chunks"],
            "targets_lost": c["targets_lost"],
            "tokens_removed": c["tokens_removed"],
            "targets_removed": c["targets_removed"],
        },
        "prepare_seconds": round(seconds, 3),
        "tokens_per_second": round(writer.n_tokens / max(seconds, 1e-9), 1),
    }
    return compute_stats(
        tally.doc_lens,
        tally.seq_lens,
        max_seq_len=cfg.max_seq_len,
        counts=counts,
        model_max_len=position_limit(cfg.model)[0] if cfg.model else None,
    )
