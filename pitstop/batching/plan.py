"""The epoch plan: which sequences form which optimizer step, then how each step is laid out.

Hand-written because no library plans at the level of the optimizer step: samplers
in torch, HF and TRL batch by micro-batch, so changing the micro-batch size changes
which documents share a step (and the tuner would be comparing different training
math). Here planning has two stages:

1. **The step plan** (`plan_steps`) depends only on (each sequence's length and trained
   tokens, max_seq_len, seed, epoch, tokens_per_step). Sequences are shuffled by (seed,
   epoch); then rows of max_seq_len are filled from a lookahead window of that order
   (the next LOOKAHEAD unplanned sequences): a row starts with the window's longest
   sequence (or the oldest unplanned one, once it has waited 2 x LOOKAHEAD places) and is
   filled best-fit, the longest that still fits first, as best-fit decreasing does over
   a whole corpus. Packed rows come out full (within 0.5% of whole-corpus BFD on the
   corpora tested, >= 99% where BFD reaches it), where planning each step's documents
   first and packing them afterwards left every step's last row part-empty.
   Rows join a step while that brings its trained (loss-target) tokens closer to
   ``tokens_per_step``, so every step but an epoch's last trains within
   ``tokens_per_step ± max_seq_len / 2`` trained tokens (`STEP_BAND`). A sequence moves
   at most ~2 x LOOKAHEAD places from its shuffled one. Past FILL_CHUNK sequences the
   shuffled order is filled in chunks of that many, each on its own and in parallel where
   there are cores (the fill is a Python pass per sequence); the plan is the same for any
   number of processes. The plan does not depend on the layout, the micro-batch size, the
   loader workers or the ranks.
2. **The layout** (the strategy) only arranges each step's sequences into rows:

   - ``pack``: the planned rows (in a shuffled order within the step), padded to
     max_seq_len (static shapes for torch.compile and CUDA graphs).
   - ``bucket``: one sequence per row, the step's rows sorted by length, so each
     micro-batch pads only to its own longest row.
   - ``pad``: one sequence per row in planned order, every row padded to max_seq_len.

So every layout trains the same documents in the same step and the same trained
tokens per step: the losses differ only by floating-point summation order, and
`auto`/`tune` compare like with like. Micro-batches and ranks are cut from each
step afterwards (`step_micro_batches`). Every sequence appears exactly once per epoch.

Memory: the step plan comes out a block of whole steps at a time as the fill hands its
chunks over (`step_plan_blocks`), and laying out, counting and summing go a block
(BLOCK) at a time, so planning holds its answer and a few blocks beyond the store's
memory-mapped facts. Under several ranks each keeps only its rows (`rank_plan.py`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import mmap
import multiprocessing
import os
import sys
from array import array
from bisect import bisect_right, insort
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from pitstop.batching.settings import BatchSettings
from pitstop.catalog.layouts import Layout
from pitstop.core import forked_workers

__all__ = [
    "STEP_BAND",
    "Efficiency",
    "MicroBatchSpec",
    "Plan",
    "build_plan",
    "keep_plan",
    "measure_efficiency",
    "plan_efficiency",
    "plan_steps",
    "release_step_plans",
    "step_micro_batches",
]

# Seeds the step plan's shuffle and pack's tie-breaks; the same for every layout.
_STEP_PLAN_CODE = 7
# How many upcoming sequences (in the shuffled order) a row may take from to fill itself.
# Larger fills rows better and moves sequences further from their shuffled place.
LOOKAHEAD = 512
# Every step but an epoch's last trains tokens_per_step ± STEP_BAND * max_seq_len tokens.
STEP_BAND = 0.5
# About how many sequences (or rows) one numpy pass of planning and counting takes at a
# time: the passes go a block of whole steps at a time, so planning holds its answer and a
# few blocks, not an array per pass over every document (~550 MB at 10M documents before).
BLOCK = 1 << 20


@dataclass(frozen=True)
class Plan:
    """One epoch, as flat arrays (cheap to build, pickle and index for millions of sequences).

    Row r holds sequences ``seqs[row_bounds[r]:row_bounds[r+1]]``; step s holds rows
    ``step_bounds[s]:step_bounds[s+1]``. ``row_tokens[r]`` is row r's real token count.
    """

    strategy: Layout
    epoch: int
    seed: int
    max_seq_len: int
    tokens_per_step: int
    seqs: np.ndarray  # int64 [n_sequences]
    row_bounds: np.ndarray  # int64 [n_rows + 1]
    step_bounds: np.ndarray  # int64 [n_steps + 1]
    row_tokens: np.ndarray  # int64 [n_rows]
    # A rank's share (rank_plan.build_rank_plans): the rows are only those `rank` of
    # `world` trains, step s its rows step_bounds[s]:step_bounds[s+1]; what needs every
    # rank's rows was counted when it was built, per step over all ranks: rows, tokens,
    # narrowest row, trained tokens and (lockstep) the most micro-batches of a rank.
    rank: int | None = None
    world: int = 1
    step_rows_all: np.ndarray | None = None
    step_tokens: np.ndarray | None = None
    step_narrowest: np.ndarray | None = None
    step_trained: np.ndarray | None = None
    step_most: np.ndarray | None = None
    # build_plan's digest of what the plan depends on (`keep_plan`), and plan_efficiency's
    # answers by micro setting: not init fields, so dataclasses.replace starts them afresh.
    key: bytes = field(default=b"", init=False, compare=False, repr=False)
    efficiencies: dict[tuple[object, ...], Efficiency] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )

    @property
    def n_steps(self) -> int:
        return len(self.step_bounds) - 1

    @property
    def n_rows(self) -> int:
        return len(self.row_bounds) - 1

    def step_rows(self, step: int) -> list[np.ndarray]:
        """Sequence ids of each row of `step`."""
        r0, r1 = int(self.step_bounds[step]), int(self.step_bounds[step + 1])
        b = self.row_bounds
        return [self.seqs[b[r] : b[r + 1]] for r in range(r0, r1)]

    def step_seq_bounds(self) -> np.ndarray:
        """int64 [n_steps + 1]: step s holds ``seqs[out[s]:out[s+1]]``."""
        return self.row_bounds[self.step_bounds]

    def per_step_sums(self, per_seq: np.ndarray) -> np.ndarray:
        """Sum of a per-sequence quantity (e.g. target tokens) over each step: int64 [n_steps]."""
        if self.rank is not None:  # it would be this rank's part only: a wrong normaliser
            raise ValueError("a rank's share of a plan holds its own rows: read step_trained")
        out, per_seq = [], np.asarray(per_seq)
        for part in self.step_blocks():
            csum = np.concatenate([[0], np.cumsum(per_seq[part.seqs], dtype=np.int64)])
            out.append(np.diff(csum[part.step_seq_bounds()]))
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def step_blocks(self) -> Iterator[Plan]:
        """The plan as consecutive plans of whole steps of about BLOCK sequences each (their
        arrays views or block-sized), for passes that add up over steps."""
        for s0, s1 in _spans(self.step_seq_bounds()):
            r0, r1 = int(self.step_bounds[s0]), int(self.step_bounds[s1])
            b0, b1 = int(self.row_bounds[r0]), int(self.row_bounds[r1])
            yield dataclasses.replace(
                self,
                seqs=self.seqs[b0:b1],
                row_bounds=self.row_bounds[r0 : r1 + 1] - b0,
                step_bounds=self.step_bounds[s0 : s1 + 1] - r0,
                row_tokens=self.row_tokens[r0:r1],
            )


def _rng(seed: int, epoch: int) -> np.random.Generator:
    # Seeded by (seed, epoch) only: epoch e of a run is reproducible on its own (resuming
    # mid-run is exact without saving any RNG state), and no layout changes the steps.
    return np.random.default_rng([seed, epoch, _STEP_PLAN_CODE])


def _spans(at: np.ndarray) -> Iterator[tuple[int, int]]:
    """Consecutive spans [i, j) of the segments ``at[i]:at[i+1]`` holding about BLOCK
    elements each (at least one segment): the blocks of a blockwise numpy pass."""
    i, k = 0, len(at) - 1
    while i < k:
        j = int(np.searchsorted(at, at[i] + BLOCK, side="right")) - 1
        j = min(k, max(i + 1, j))
        yield i, j
        i = j


def gather_segments(
    flat: np.ndarray, bounds: np.ndarray, order: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Reorder the segments ``flat[bounds[i]:bounds[i+1]]`` into `order`; returns (flat,
    bounds). A block of segments at a time (the index of every element at once was three
    arrays of 8 bytes per element)."""
    sizes = np.diff(bounds)[order]
    new_bounds = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(sizes, out=new_bounds[1:])
    shift = bounds[:-1][order] - new_bounds[:-1]  # per segment: where it was - where it goes
    out = np.empty(int(new_bounds[-1]), dtype=flat.dtype)
    for i, j in _spans(new_bounds):
        a, b = int(new_bounds[i]), int(new_bounds[j])
        out[a:b] = flat[np.repeat(shift[i:j], sizes[i:j]) + np.arange(a, b)]
    return out, new_bounds


_NO_FIFO: deque[int] = deque(maxlen=0)  # a length that never occurs never waits


def _fill_rows(lengths: np.ndarray, msl: int, window: int = LOOKAHEAD) -> tuple[array, array]:
    """Rows of capacity `msl` over sequences 0..n-1 (lengths in planned order): each row
    starts with the longest of the next `window` unplaced sequences (the oldest unplaced
    one once it is 2 x `window` places behind), then takes the longest that fits from the
    window until none fits; among equal lengths the oldest. Returns (sequences row by row,
    row bounds) as int64 arrays.

    The window is kept as one FIFO per length (sequences enter it in order, so each FIFO's
    front is its oldest and every sequence taken is a front) and the ascending list of the
    lengths waiting: a step is one bisect over at most `window` distinct lengths and a
    popleft, a third of the CPU time of one sorted list of every waiting sequence (the
    implementation before, 0.74 s -> 0.23 s for 300,000 long-tailed sequences), and the same
    rows (tests/test_plan_fill.py holds it against that implementation). Memory: 8 bytes
    per sequence for `lengths` as an array, 8 for the answer, 1 for the placed flags
    (`array` holds plain machine ints, no int objects), 8 per possible length."""
    n = len(lengths)
    lens = array("q", np.ascontiguousarray(lengths, dtype=np.int64).tobytes())
    placed = bytearray(n)
    # fifos[length]: the waiting sequences of that length, oldest first (one per length
    # that occurs; a list indexed by length is a third faster than a dict).
    fifos: list[deque[int]] = [_NO_FIFO] * (int(lengths.max()) + 1 if n else 1)
    for length in np.unique(lengths).tolist():
        fifos[length] = deque()
    waiting: list[int] = []  # the lengths with a waiting sequence, ascending
    flat, bounds = array("q"), array("q", [0])
    nxt = head = size = 0  # next sequence to enter the window; oldest unplaced; window size

    while head < n:
        while nxt < n and size < window:
            length = lens[nxt]
            fifo = fifos[length]
            if not fifo:
                insort(waiting, length)
            fifo.append(nxt)
            nxt += 1
            size += 1
        while placed[head]:
            head += 1
        # The oldest starts the row once it has waited 2 x window places, else the longest
        # (as in best-fit decreasing); either is the front of its length's FIFO.
        length = lens[head] if nxt - head >= 2 * window else waiting[-1]
        fifo = fifos[length]
        first = fifo.popleft()
        if not fifo:
            waiting.remove(length)
        size -= 1
        placed[first] = 1
        flat.append(first)
        cap = msl - length
        while cap > 0:
            j = bisect_right(waiting, cap) - 1  # the longest waiting length that fits
            if j < 0:
                break
            length = waiting[j]
            fifo = fifos[length]
            i = fifo.popleft()
            if not fifo:
                del waiting[j]
            placed[i] = 1
            flat.append(i)
            cap -= length
            if nxt < n:  # the window takes the next sequence in place of the one placed
                length = lens[nxt]
                fifo = fifos[length]
                if not fifo:
                    insort(waiting, length)
                fifo.append(nxt)  # (inline: a call per sequence cost a third of the time)
                nxt += 1
            else:
                size -= 1
        bounds.append(len(flat))
        while head < n and placed[head]:
            head += 1
    return flat, bounds


# Rows are filled within consecutive chunks of this many sequences of the shuffled order,
# each chunk on its own (in parallel where there are cores): the fill is a Python pass per
# sequence (~0.8 s per million on the 2-core box), and a chunk's last rows are the only
# ones that could have been fuller. A plan of fewer sequences is one chunk (as before).
FILL_CHUNK = 1 << 18
# Most processes the fill uses (each holds one chunk: ~10 MB).
FILL_WORKERS = 8


def _fill_job(job: tuple[np.ndarray, int]) -> tuple[array, array]:
    return _fill_rows(*job)  # the module's _fill_rows, so a test's replacement is used


def _filled(
    lengths: np.ndarray, order: np.ndarray, msl: int
) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Per FILL_CHUNK of the planned order (`order`, positions into `lengths`), in order:
    (the chunk's first place, its places row by row counted from that first one, its row
    bounds). The same answer whatever the number of processes; at most one chunk per
    process plus one is in flight, so memory does not grow with the data."""
    n = len(order)
    spans = [(a, min(n, a + FILL_CHUNK)) for a in range(0, n, FILL_CHUNK)]

    def job(a: int, b: int) -> tuple[np.ndarray, int]:
        return lengths[order[a:b]], msl

    def arrays(a: int, part: tuple[array, array]) -> tuple[int, np.ndarray, np.ndarray]:
        return a, np.frombuffer(part[0], dtype=np.int64), np.frombuffer(part[1], dtype=np.int64)

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    # Under torchrun every rank on this machine plans at once: each takes its share of cores.
    ranks_here = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    workers = min(FILL_WORKERS, (cores or 1) // ranks_here, len(spans))
    if workers <= 1 or not sys.platform.startswith("linux"):
        for a, b in spans:
            yield arrays(a, _fill_job(job(a, b)))
        return
    # fork: the workers start in milliseconds and need nothing but their chunk (Linux only:
    # macOS offers fork but its system frameworks are not fork-safe). Their stop is prepare's
    # pool's (`forked_workers`): Ctrl-C is the parent's alone, and a stop ends the workers.
    ex = ProcessPoolExecutor(
        workers,
        mp_context=multiprocessing.get_context("fork"),
        initializer=forked_workers.worker_signals,
    )
    try:
        pending: deque[tuple[int, Future[tuple[array, array]]]] = deque()
        for a, b in spans:
            with forked_workers.stop_signals_blocked():  # a submit may fork a worker
                pending.append((a, ex.submit(_fill_job, job(a, b))))
            if len(pending) > workers:
                first, fut = pending.popleft()
                yield arrays(first, fut.result())
        while pending:
            first, fut = pending.popleft()
            yield arrays(first, fut.result())
    except BaseException:  # a stop, a failure, or the plan's reader gone (GeneratorExit)
        forked_workers.end_workers(ex)
        raise
    finally:
        ex.shutdown(wait=True, cancel_futures=True)


class _StepCutter:
    """Step boundaries over rows fed in order, a chunk at a time: a row joins the step while
    that brings the step's trained tokens closer to `budget` (so a step ends within budget ±
    half its largest row). The same boundaries as one pass over every row."""

    def __init__(self, budget: int) -> None:
        self.budget, self.total, self.last = budget, 0, 0  # trained in the open step; its first row

    def feed(self, row_trained: list[int], first_row: int) -> list[int]:
        """The step ends (global row indices) that rows ``first_row, first_row + 1, ...``
        close."""
        ends: list[int] = []
        budget, total, last = self.budget, self.total, self.last
        for r, t in enumerate(row_trained, start=first_row):
            if r > last and t >= 2 * (budget - total):
                ends.append(r)  # the row would overshoot by more than it is short: next step
                last, total = r, 0
            total += t
            if total >= budget:
                ends.append(r + 1)
                last, total = r + 1, 0
        self.total, self.last = total, last
        return ends


def _shuffle(n: int, seed: int, epoch: int) -> tuple[np.ndarray, Callable[[int, int], None]]:
    """The epoch's shuffled order of positions 0..n-1, and `release(a, b)`, which hands the
    memory of positions [a, b) back once they are planned. The same permutation as
    ``permutation(n)`` (Generator.shuffle draws the same swaps whatever the dtype), in
    int32, in its own anonymous memory map: planning returns its pages chunk by chunk as
    its answer grows, so its peak is not the two added up (4 bytes per sequence at 10M
    documents is 41 MB on every rank)."""
    dtype = np.dtype(np.int32 if n < 2**31 else np.int64)
    # Private: the default anonymous map is shared memory, which MADV_DONTNEED keeps.
    private = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    size = max(1, n * dtype.itemsize)
    buf = mmap.mmap(-1, size, flags=private) if private else mmap.mmap(-1, size)
    order = np.frombuffer(buf, dtype=dtype, count=n)
    for a in range(0, n, BLOCK):  # arange a block at a time: no second array of n
        order[a : a + BLOCK] = np.arange(a, min(n, a + BLOCK), dtype=dtype)
    _rng(seed, epoch).shuffle(order)
    page = mmap.PAGESIZE

    def release(a: int, b: int) -> None:
        lo = -(-a * dtype.itemsize // page) * page  # whole pages inside [a, b) only
        hi = b * dtype.itemsize // page * page
        if hi > lo and hasattr(buf, "madvise"):
            buf.madvise(mmap.MADV_DONTNEED, lo, hi - lo)  # read as zeros after: never read

    return order, release


def step_plan_blocks(
    trained: np.ndarray, lengths: np.ndarray, msl: int, tps: int, seed: int, epoch: int
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """The step plan (`plan_steps`) as consecutive blocks of whole steps, in order, each
    ``(seqs, row_bounds, step_rows, row_tokens)`` counted from the block's start: built as
    the fill hands chunks over, so holding a block at a time needs the shuffle (4 bytes per
    sequence) and a few chunks, not the whole plan."""
    n = len(trained)
    if not n:
        return
    order, release = _shuffle(n, seed, epoch)
    cutter = _StepCutter(tps)
    seqs: list[np.ndarray] = []  # the rows not yet in a closed step, as the chunks gave them
    sizes: list[np.ndarray] = []  # their sequences per row
    tokens_rows: list[np.ndarray] = []  # their tokens
    first_row = rows_seen = 0  # global index of the first pending row; rows filled so far

    def row_sums(per_seq: np.ndarray, chunk: np.ndarray, rb: np.ndarray) -> np.ndarray:
        csum = np.concatenate([[0], np.cumsum(per_seq[chunk], dtype=np.int64)])
        return np.diff(csum[rb])

    def closed(ends: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        nonlocal seqs, sizes, tokens_rows, first_row
        size, tok, flat = np.concatenate(sizes), np.concatenate(tokens_rows), np.concatenate(seqs)
        k = ends[-1] - first_row  # rows of the closed steps
        bounds = np.zeros(len(size) + 1, dtype=np.int64)
        np.cumsum(size, out=bounds[1:])
        cut = int(bounds[k])
        block = (
            flat[:cut],
            bounds[: k + 1],
            np.asarray([0] + [e - first_row for e in ends], dtype=np.int64),
            tok[:k],
        )
        seqs, sizes, tokens_rows = [flat[cut:]], [size[k:]], [tok[k:]]
        first_row = ends[-1]
        return block

    for a, flat, rb in _filled(lengths, order, msl):
        chunk = order[a : a + len(flat)][flat].astype(np.int64)
        release(a, a + len(flat))  # every job that reads it was made before this chunk's
        seqs.append(chunk)
        sizes.append(np.diff(rb))
        tokens_rows.append(row_sums(lengths, chunk, rb))
        ends = cutter.feed(row_sums(trained, chunk, rb).tolist(), rows_seen)
        rows_seen += len(rb) - 1
        if ends:
            yield closed(ends)
    if rows_seen > first_row:  # the epoch's last step: what is left
        yield closed([rows_seen])


def plan_steps(
    trained: np.ndarray,
    lengths: np.ndarray,
    *,
    max_seq_len: int,
    tokens_per_step: int,
    seed: int,
    epoch: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The step plan: ``(seqs, row_bounds, step_bounds, row_tokens)``; row r is positions
    ``seqs[row_bounds[r]:row_bounds[r+1]]`` (full rows of `max_seq_len`, module docstring)
    holding ``row_tokens[r]`` tokens, step s is rows ``step_bounds[s]:step_bounds[s+1]``.
    Positions index `trained` and `lengths` (each sequence's trained tokens and tokens).
    The blocks of `step_plan_blocks` put together: beyond the answer (8 bytes per
    sequence, 16 per row) it holds the shuffle (4 bytes per sequence) and a few chunks."""
    trained, lengths = np.asarray(trained), np.asarray(lengths)
    seqs = np.empty(len(trained), dtype=np.int64)
    row_bounds, step_rows, row_tokens = [np.zeros(1, np.int64)], [np.zeros(1, np.int64)], []
    placed = rows = 0
    for flat, rb, sr, tok in step_plan_blocks(
        trained, lengths, max_seq_len, tokens_per_step, seed, epoch
    ):
        seqs[placed : placed + len(flat)] = flat
        row_bounds.append(rb[1:] + placed)
        step_rows.append(sr[1:] + rows)
        row_tokens.append(tok)
        placed, rows = placed + len(flat), rows + len(tok)
    tokens = np.concatenate(row_tokens) if row_tokens else np.zeros(0, np.int64)
    return seqs, np.concatenate(row_bounds), np.concatenate(step_rows), tokens


# The last step plan built, by a digest of everything it depends on: `batching: auto`
# lays out pack, bucket and pad over one step plan and the loader then plans the same
# epoch, and each plan is a pass over every document in Python (~1 s per million). The
# arrays are read-only, so no layout can change them under another. One entry: a plan
# holds ~16 bytes per document.
_STEP_PLANS: dict[bytes, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
# The layout `batching: auto` chose (`keep_plan`), for the loader's plan of the same epoch:
# laying it out again and counting its efficiency cost ~2 s at 10M documents. One entry.
_KEPT: dict[tuple[bytes, Layout], Plan] = {}


def release_step_plans() -> None:
    """Drop the shared step plan and the kept layout (the loader calls this once its own
    plan is built)."""
    _STEP_PLANS.clear()
    _KEPT.clear()


def kept_plan(key: bytes, layout: Layout) -> Plan | None:
    """The plan `keep_plan` kept for these arguments (`key`, a digest of them), if any."""
    return _KEPT.get((key, Layout.parse(layout)))


def layout_rng(seed: int, epoch: int) -> np.random.Generator:
    """The generator of pack's row order within each step (the same for every layout call)."""
    return np.random.default_rng([seed, epoch, _STEP_PLAN_CODE + 1])


def keep_plan(plan: Plan) -> None:
    """Keep `plan` for the next `build_plan` of the same arguments (until
    `release_step_plans`): `batching: auto` keeps the layout it chose for the loader."""
    _KEPT.clear()
    if plan.key:
        _KEPT[(plan.key, Layout.parse(plan.strategy))] = plan


def plan_key(
    trained: np.ndarray,
    lengths: np.ndarray,
    indices: np.ndarray | None,
    msl: int,
    tps: int,
    seed: int,
    epoch: int,
) -> bytes:
    """A digest of everything a plan depends on: exact contents, not identity (collision-free)."""
    # sha256: OpenSSL's, 2.5x blake2b's speed here (0.2 s per plan at 10M documents)
    h = hashlib.sha256(repr((msl, tps, seed, epoch, len(lengths))).encode())
    for a in (trained, lengths) + (() if indices is None else (indices,)):
        a = np.ascontiguousarray(a)  # its own bytes and dtype: no int64 copy of an int32 array
        h.update(a.dtype.str.encode())
        h.update(memoryview(a).cast("B"))
    h.update(b"all" if indices is None else b"some")
    return h.digest()[:16]


def _shared_plan_steps(
    key: bytes, trained: np.ndarray, lengths: np.ndarray, msl: int, tps: int, seed: int, epoch: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`plan_steps` of these arguments (digested as `key`), computed once per process while
    they repeat."""
    hit = _STEP_PLANS.get(key)
    if hit is not None:
        return hit
    out = plan_steps(trained, lengths, max_seq_len=msl, tokens_per_step=tps, seed=seed, epoch=epoch)
    for a in out:
        a.flags.writeable = False
    _STEP_PLANS.clear()
    _STEP_PLANS[key] = out
    return out


def layout_rows(
    seqs: np.ndarray,
    row_bounds: np.ndarray,
    step_rows: np.ndarray,
    row_tokens: np.ndarray,
    lengths: np.ndarray,
    strategy: Layout,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each step's planned sequences arranged into rows: ``(seqs, row_bounds, step_bounds,
    row_tokens)``."""
    layout = Layout.parse(strategy)
    if layout.packed:
        # The planned rows; shuffled within each step, so ranks dealt rows round-robin get
        # a fair mix of documents.
        perm = np.concatenate(
            [s0 + rng.permutation(s1 - s0) for s0, s1 in itertools.pairwise(step_rows)]
        ).astype(np.int64)
        flat, bounds = gather_segments(seqs, row_bounds, perm)
        return flat, bounds, step_rows, row_tokens[perm]
    step_bounds = row_bounds[step_rows]  # one sequence per row: rows are sequences
    order = seqs
    if layout is Layout.BUCKET:
        # Longest first within each step (ties keep the planned order), so micro-batches
        # cut from a step hold rows of similar length and pad little.
        # One int64 key, sorted stably (ties keep the planned order): a third of the time
        # of a three-key lexsort (4.4 s -> 1.1 s at 10M sequences on the 2-core box).
        # Each step sorts on its own, so a block of whole steps at a time.
        order = np.empty_like(seqs)
        longest = int(lengths.max()) if len(lengths) else 0
        for s0, s1 in _spans(step_bounds):
            a, b = int(step_bounds[s0]), int(step_bounds[s1])
            per_step = np.diff(step_bounds[s0 : s1 + 1])
            step_of = np.repeat(np.arange(s1 - s0, dtype=np.int64), per_step)
            key = step_of * (longest + 1) + (longest - lengths[seqs[a:b]])
            order[a:b] = seqs[a:b][np.argsort(key, kind="stable")]
    elif layout is not Layout.PAD:
        raise ValueError(f"no rows for batching layout {layout!r}")  # a new, unplanned layout
    return order, np.arange(len(order) + 1, dtype=np.int64), step_bounds, lengths[order]


def build_plan(
    lengths: np.ndarray,
    *,
    strategy: Layout,
    max_seq_len: int,
    tokens_per_step: int,
    seed: int,
    epoch: int,
    indices: np.ndarray | None = None,
    trained: np.ndarray | None = None,
) -> Plan:
    """The deterministic plan of one epoch (same arguments, same plan, on every rank).

    `trained` (integers, one per store sequence) is each sequence's trained-token count,
    the unit of `tokens_per_step` (the loader passes `sequence_targets`); None counts
    every token. `indices` (int64, sorted) restricts the plan to those sequence ids of
    the store (the rest, e.g. a held-out evaluation share, never appears); `seqs` in
    the plan are still store ids, each index exactly once per epoch. Only the rows
    depend on `strategy`: which sequences form each step does not.
    """
    sub_lengths, sub_trained = planned_facts(lengths, trained, indices, max_seq_len)
    key = plan_key(sub_trained, sub_lengths, indices, max_seq_len, tokens_per_step, seed, epoch)
    kept = kept_plan(key, strategy)
    if kept is not None:
        return kept
    step_plan = _shared_plan_steps(
        key, sub_trained, sub_lengths, max_seq_len, tokens_per_step, seed, epoch
    )
    shape = (epoch, seed, max_seq_len, tokens_per_step)
    plan = laid_out(step_plan, sub_lengths, strategy, layout_rng(seed, epoch), indices, shape)
    object.__setattr__(plan, "key", key)
    return plan


def planned_facts(
    lengths: np.ndarray, trained: np.ndarray | None, indices: np.ndarray | None, msl: int
) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, trained tokens) of the sequences a plan covers (`indices`, else all).
    As given (the store's uint32 facts, memory-mapped): an int64 copy of each was 16 bytes
    per document per plan; every sum is taken in int64."""
    sub_lengths = np.asarray(lengths)
    sub_trained = sub_lengths if trained is None else np.asarray(trained)
    if indices is not None:
        idx = np.asarray(indices, np.int64)
        sub_lengths, sub_trained = sub_lengths[idx], sub_trained[idx]
    if len(sub_lengths) and sub_lengths.max() > msl:
        raise ValueError(
            f"a sequence has {int(sub_lengths.max())} tokens, above max_seq_len {msl}"
        )  # the store was prepared for a longer max length: a caller bug, the loader checks first
    return sub_lengths, sub_trained


def laid_out(
    step_plan: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    lengths: np.ndarray,
    strategy: Layout,
    rng: np.random.Generator,
    indices: np.ndarray | None,
    shape: tuple[int, int, int, int],
) -> Plan:
    """The Plan of a step plan (or a block of one) laid out as `strategy` (`layout_rows`),
    its sequences as store ids. `shape`: (epoch, seed, max_seq_len, tokens_per_step)."""
    seqs, row_bounds, step_bounds, row_tokens = layout_rows(*step_plan, lengths, strategy, rng)
    if indices is not None:
        seqs = np.asarray(indices, np.int64)[seqs]  # positions in the subset -> store ids
    epoch, seed, msl, tps = shape
    return Plan(
        strategy=strategy,
        epoch=epoch,
        seed=seed,
        max_seq_len=msl,
        tokens_per_step=tps,
        seqs=np.asarray(seqs, dtype=np.int64),
        row_bounds=row_bounds,
        step_bounds=step_bounds,
        row_tokens=np.asarray(row_tokens, dtype=np.int64),
    )


@dataclass(frozen=True)
class MicroBatchSpec:
    """One micro-batch before reading: rows of sequence ids, padded to `width` positions.

    A *filler* has no rows: a rank that got no rows of a step computes one row of
    padding only (zero targets), so every rank runs the same steps in lockstep.
    """

    rows: tuple[np.ndarray, ...]
    width: int  # T, positions per row

    @property
    def filler(self) -> bool:
        return not self.rows

    @property
    def n_positions(self) -> int:
        return max(1, len(self.rows)) * self.width


def step_micro_batches(
    plan: Plan, step: int, settings: BatchSettings, rank: int = 0, *, lockstep: bool = False
) -> list[MicroBatchSpec]:
    """Rank `rank`'s micro-batches of `step`: rows dealt round-robin, then split by the micro setting.

    Round-robin dealing keeps ranks balanced when bucket rows are sorted by length.
    A rank left without rows (a step with fewer rows than ranks, e.g. the last one of
    an epoch) gets a single filler micro-batch: no data is dropped or repeated, and
    the step's loss normaliser (its target count) is unchanged.

    `lockstep=True` appends filler micro-batches so every rank has as many as the rank
    with the most: FSDP gathers parameters in every forward, a collective all ranks
    must join the same number of times (DDP communicates once per step and needs no
    such padding).
    """
    specs = _rank_micro_batches(plan, step, settings, rank)
    if lockstep and settings.world_size > 1:
        if plan.rank is None:
            ranks = range(settings.world_size)
            most = max(len(_rank_micro_batches(plan, step, settings, r)) for r in ranks)
        elif plan.step_most is not None:
            most = int(plan.step_most[step])
        else:
            raise ValueError("this rank's share was built without lockstep: build it with lockstep")
        fixed = Layout.parse(plan.strategy).fixed_rows
        filler = MicroBatchSpec((), plan.max_seq_len if fixed else _filler_width(plan, step))
        specs = specs + [filler] * (most - len(specs))
    return specs


def _filler_width(plan: Plan, step: int) -> int:
    if plan.step_narrowest is not None:
        return int(plan.step_narrowest[step])
    r0, r1 = int(plan.step_bounds[step]), int(plan.step_bounds[step + 1])
    return int(plan.row_tokens[r0:r1].min()) if r1 > r0 else plan.max_seq_len


def _rank_micro_batches(
    plan: Plan, step: int, settings: BatchSettings, rank: int
) -> list[MicroBatchSpec]:
    world = settings.world_size
    r0, r1 = int(plan.step_bounds[step]), int(plan.step_bounds[step + 1])
    if plan.rank is not None:  # a rank's share: its rows, dealt when it was built
        if (rank, world) != (plan.rank, plan.world):
            raise ValueError(
                f"a plan of rank {plan.rank} of {plan.world} asked for rank {rank} of {world}"
            )
        rows_idx = list(range(r0, r1))
    else:
        rows_idx = list(range(r0 + rank, r1, world))
    fixed = Layout.parse(plan.strategy).fixed_rows
    msl = plan.max_seq_len
    if not rows_idx:
        width = msl if fixed else _filler_width(plan, step)
        return [MicroBatchSpec((), width)]
    b = plan.row_bounds
    rows = [plan.seqs[b[r] : b[r + 1]] for r in rows_idx]
    lens = [int(plan.row_tokens[r]) for r in rows_idx]
    groups: list[tuple[int, int]] = []  # [start, end) into rows
    if settings.micro_batch_size is not None:
        k = settings.micro_batch_size
        groups = [(i, min(i + k, len(rows))) for i in range(0, len(rows), k)]
    else:
        budget = settings.tokens_per_micro_batch
        assert budget is not None
        start, longest = 0, 0
        for i, length in enumerate(lens):
            w = msl if fixed else max(longest, length)
            if i > start and (i - start + 1) * w > budget:
                groups.append((start, i))
                start, w = i, (msl if fixed else length)
            longest = w
        groups.append((start, len(rows)))
    return [MicroBatchSpec(tuple(rows[a:e]), msl if fixed else max(lens[a:e])) for a, e in groups]


@dataclass(frozen=True)
class Efficiency:
    """Real tokens vs positions computed for a plan under a micro-batch setting."""

    seen_tokens: int  # non-padding input tokens
    positions: int  # every position computed, padding and filler rows included
    steps: int
    micro_batches: int
    # Sum over the attention segments of every computed row of (segment length)^2: a
    # segment is a document, the row's padding continuing its last one (as collate lays
    # them out), a filler row one segment. Whole rows where the lengths were not given.
    attention_squares: int = 0

    @property
    def packing_efficiency(self) -> float:
        return self.seen_tokens / self.positions if self.positions else 1.0

    @property
    def padding_waste(self) -> float:
        return 1.0 - self.packing_efficiency

    @property
    def attention_span(self) -> float | None:
        """Positions a computed position attends over, on average over positions: sum of
        squared segment lengths / positions (a segment of n positions attends n^2 pairs).
        The T of the FLOPs formula's 12·L·d·T: the row length for one document per row,
        less for packed rows of shorter documents. None when nothing was counted."""
        return self.attention_squares / self.positions if self.attention_squares else None


def plan_efficiency(
    plan: Plan,
    settings: BatchSettings,
    *,
    lockstep: bool = False,
    lengths: np.ndarray | None = None,
) -> Efficiency:
    """Efficiency of `plan` over all ranks' micro-batches, without reading tokens or running a model.

    `lengths` (the store's sequence lengths, indexed by the plan's store ids) lets packed
    rows count their documents' attention segments; without them a packed row counts as
    one segment (its whole width), as every row of the one-sequence-per-row layouts does."""
    # Counted once per plan and micro setting (auto counts the layout it keeps for the
    # loader); `lengths` must be the ones the plan was built from, as the docstring says.
    memo = efficiency_key(settings, lockstep, with_lengths=lengths is not None)
    hit = plan.efficiencies.get(memo)
    if hit is None:
        hit = plan.efficiencies[memo] = _plan_efficiency(plan, settings, lockstep, lengths)
    return hit


def efficiency_key(
    settings: BatchSettings, lockstep: bool, *, with_lengths: bool
) -> tuple[object, ...]:
    """What a plan's efficiency depends on besides the plan (its `efficiencies` key)."""
    s = settings
    return (s.world_size, s.micro_batch_size, s.tokens_per_micro_batch, lockstep, with_lengths)


def _plan_efficiency(
    plan: Plan, settings: BatchSettings, lockstep: bool, lengths: np.ndarray | None
) -> Efficiency:
    """Efficiency summed over the plan's blocks of steps (every count adds up over steps)."""
    layout = Layout.parse(plan.strategy)
    if plan.rank is not None:
        # A rank's share was counted over every rank when built; pad's rows (bucket's, one
        # per row, each max_seq_len wide) need only each step's row count and tokens.
        if not layout.fixed_rows or layout.packed:
            raise ValueError(
                "a rank's share of a plan is counted when it is built (build_rank_plans): "
                "ask for the settings and lockstep it was built with"
            )
        return block_efficiency(plan, settings, lockstep, None)
    parts = (block_efficiency(part, settings, lockstep, lengths) for part in plan.step_blocks())
    return summed_efficiency(parts, plan.n_steps)


def summed_efficiency(parts: Iterable[Efficiency], steps: int) -> Efficiency:
    """The efficiency of consecutive blocks of whole steps (every count adds up over steps)."""
    seen = positions = micro = squares = 0
    for e in parts:
        seen, positions = seen + e.seen_tokens, positions + e.positions
        micro, squares = micro + e.micro_batches, squares + e.attention_squares
    return Efficiency(seen, positions, steps, micro, squares)


def block_efficiency(
    plan: Plan, settings: BatchSettings, lockstep: bool, lengths: np.ndarray | None
) -> Efficiency:
    layout = Layout.parse(plan.strategy)
    if layout.fixed_rows:
        positions, micro, row_squares = _fixed_width_counts(plan, settings, lockstep)
    else:
        positions, micro, row_squares = _sorted_rows_counts(plan, settings, lockstep)
    squares = row_squares
    if layout.packed and lengths is not None and plan.n_rows:
        squares = _packed_attention_squares(plan, lengths, positions)
    tokens = plan.row_tokens if plan.step_tokens is None else plan.step_tokens
    return Efficiency(int(tokens.sum()), positions, plan.n_steps, micro, squares)


def _counted(plan: Plan, settings: BatchSettings, lockstep: bool) -> tuple[int, int, int]:
    """(positions, micro-batches, sum of positions x width) by walking every step's
    micro-batches on every rank: what the loader will hand out, exactly."""
    positions = micro = row_squares = 0
    for step in range(plan.n_steps):
        for rank in range(settings.world_size):
            specs = step_micro_batches(plan, step, settings, rank, lockstep=lockstep)
            micro += len(specs)
            positions += sum(s.n_positions for s in specs)
            row_squares += sum(s.n_positions * s.width for s in specs)
    return positions, micro, row_squares


def _sorted_rows_counts(
    plan: Plan, settings: BatchSettings, lockstep: bool
) -> tuple[int, int, int]:
    """`_counted` for rows as wide as their longest (bucket), in numpy over the rows and
    Python over micro-batches only (the walk over every row of every step took 1.6 s of
    start-up at a million documents). Bucket sorts each step's rows longest first, so a
    rank's rows (every world-th) are too, and a micro-batch is as wide as its first row:
    by rows, every k rows from a rank's first; by tokens, a micro-batch starting at a row
    of width w holds max(1, budget // w) rows. Rows in another order are walked
    (`_counted`). tests/test_batching_plan.py holds the two equal."""
    got = _sorted_rank_counts(plan, settings)
    if got is None:
        return _counted(plan, settings, lockstep)
    positions, squares, counts, narrowest = got
    if lockstep and settings.world_size > 1:
        fillers = (counts.max(axis=0) - counts).sum(axis=0)  # per step, over the ranks
        positions += int((fillers * narrowest).sum())
        squares += int((fillers * narrowest * narrowest).sum())
        counts = counts + (counts.max(axis=0) - counts)
    return positions, int(counts.sum()), squares


def _sorted_rank_counts(
    plan: Plan, settings: BatchSettings
) -> tuple[int, int, np.ndarray, np.ndarray] | None:
    """(positions, attention squares, micro-batches [world, n_steps], each step's narrowest
    row) of rows sorted longest first in each step, before lockstep; None for rows in
    another order."""
    world, msl = settings.world_size, plan.max_seq_len
    n_steps = plan.n_steps
    bounds = np.asarray(plan.step_bounds, dtype=np.int64)
    widths = np.asarray(plan.row_tokens, dtype=np.int64)
    step_of = np.repeat(np.arange(n_steps), np.diff(bounds))
    same_step = step_of[1:] == step_of[:-1]
    if np.any(np.diff(widths)[same_step] > 0):
        return None
    place = np.arange(len(widths)) - bounds[step_of]  # the row's place in its step
    # A rank without rows of a step computes one filler row as wide as the step's
    # narrowest row (its last), or max_seq_len for a step without rows.
    narrowest = np.full(n_steps, msl, dtype=np.int64)
    has_rows = bounds[1:] > bounds[:-1]
    narrowest[has_rows] = widths[bounds[1:][has_rows] - 1]
    counts = np.zeros((world, n_steps), dtype=np.int64)  # micro-batches per rank and step
    positions = squares = 0
    for rank in range(world):
        if world == 1:  # every row is the rank's: views, not gathers of every row
            w, steps, j = widths, step_of, place
        else:
            mine = np.flatnonzero(place % world == rank)
            w, steps = widths[mine], step_of[mine]
            j = place[mine] // world  # the row's place in the rank's rows of its step
        if settings.micro_batch_size is not None:
            starts = np.flatnonzero(j % settings.micro_batch_size == 0)
        else:
            budget = settings.tokens_per_micro_batch
            assert budget is not None
            starts = _greedy_starts(w, j == 0, budget)
        size = np.diff(np.append(starts, len(w)))
        width = w[starts]
        positions += int((size * width).sum())
        squares += int((size * width * width).sum())
        counts[rank] = np.bincount(steps[starts], minlength=n_steps)
        empty = counts[rank] == 0
        counts[rank][empty] = 1
        positions += int(narrowest[empty].sum())
        squares += int((narrowest[empty] ** 2).sum())
    return positions, squares, counts, narrowest


def _greedy_starts(widths: np.ndarray, step_first: np.ndarray, budget: int) -> np.ndarray:
    """First rows of a rank's micro-batches by a token budget, over its rows longest first
    within each step: a micro-batch starting at a row of width w holds up to
    max(1, budget // w) rows, and never crosses into the next step.

    Every step's micro-batches are cut at once, one micro-batch of every step per numpy
    pass (as many passes as the most micro-batches in a step, tens): the same starts as
    walking the rows one by one in Python (2.4 s at 10M documents on the 2-core box, now
    ~0.1 s; tests/test_plan_efficiency.py holds the two equal)."""
    n = len(widths)
    firsts = np.flatnonzero(step_first)
    if n and (not len(firsts) or firsts[0] != 0):
        firsts = np.concatenate([[0], firsts])  # rows before a step's first: a step of their own
    ends = np.append(firsts[1:], n)  # each step's rows are firsts[k]:ends[k]
    cap = np.maximum(1, budget // np.maximum(1, np.asarray(widths, dtype=np.int64)))
    starts, cur = [], firsts.astype(np.int64)
    while len(cur):
        starts.append(cur)
        nxt = cur + cap[cur]
        more = nxt < ends
        cur, ends = nxt[more], ends[more]
    return np.sort(np.concatenate(starts)) if starts else np.zeros(0, dtype=np.int64)


def _fixed_width_counts(
    plan: Plan, settings: BatchSettings, lockstep: bool
) -> tuple[int, int, int]:
    """`_counted` for the layouts whose rows are all max_seq_len wide (pack, pad), in numpy
    over the steps instead of Python over every micro-batch (3 s of start-up at a million
    documents): rank r gets every world-th row of a step; its micro-batches hold the
    micro setting's rows each, a rank without rows one filler row; under lockstep every
    rank is filled up to the most micro-batches. tests/test_batching_plan.py holds the two
    equal."""
    msl, world = plan.max_seq_len, settings.world_size
    micro = _fixed_width_micro(plan, settings)
    positions = int(np.maximum(1, _rank_rows(plan, world)).sum()) * msl  # a filler if none
    count = int(micro.sum())
    if lockstep and world > 1:
        fillers = int((micro.max(axis=0) - micro).sum())
        count += fillers
        positions += fillers * msl
    return positions, count, positions * msl


def _rank_rows(plan: Plan, world: int) -> np.ndarray:
    """int64 [world, n_steps]: each rank's rows of each step (dealt round-robin)."""
    if plan.step_rows_all is not None:  # a rank's share: counted over every rank
        n = np.asarray(plan.step_rows_all, dtype=np.int64)
    else:
        n = np.diff(np.asarray(plan.step_bounds, dtype=np.int64))
    return np.stack([np.maximum(0, (n - r + world - 1) // world) for r in range(world)])


def _fixed_width_micro(plan: Plan, settings: BatchSettings) -> np.ndarray:
    """int64 [world, n_steps]: each rank's micro-batches of each step, rows max_seq_len wide."""
    world, msl = settings.world_size, plan.max_seq_len
    if settings.micro_batch_size is not None:
        per = settings.micro_batch_size
    else:
        assert settings.tokens_per_micro_batch is not None
        per = max(1, settings.tokens_per_micro_batch // msl)  # whole rows of msl positions
    rows = _rank_rows(plan, world)
    return np.where(rows == 0, 1, -(-rows // per))


def micro_counts(plan: Plan, settings: BatchSettings) -> np.ndarray:
    """int64 [world, n_steps]: the micro-batches each rank gets in each step of a whole plan,
    before lockstep evens them out (rank_plan keeps each step's most)."""
    if Layout.parse(plan.strategy).fixed_rows or settings.micro_batch_size is not None:
        return _fixed_width_micro(plan, settings)  # k rows to a micro-batch either way
    got = _sorted_rank_counts(plan, settings)
    if got is not None:
        return got[2]
    return np.asarray(
        [
            [len(_rank_micro_batches(plan, step, settings, r)) for step in range(plan.n_steps)]
            for r in range(settings.world_size)
        ],
        dtype=np.int64,
    ).reshape(settings.world_size, plan.n_steps)


def _packed_attention_squares(plan: Plan, lengths: np.ndarray, positions: int) -> int:
    """Sum of squared attention segments over a packed plan's computed rows: each row's
    documents, its last one extended through the row's padding to max_seq_len, plus one
    full-width segment per filler row (every packed micro-batch is max_seq_len wide)."""
    msl = plan.max_seq_len
    # int64: n <= max_seq_len, so n^2 sums stay far below 2^63
    lens = np.asarray(np.asarray(lengths)[plan.seqs], dtype=np.int64)
    csum = np.concatenate([[0], np.cumsum(lens * lens)])
    docs = int((csum[plan.row_bounds[1:]] - csum[plan.row_bounds[:-1]]).sum())
    last = lens[plan.row_bounds[1:] - 1]
    padded = last + (msl - plan.row_tokens)
    extended = int((padded * padded - last * last).sum())
    fillers = positions // msl - plan.n_rows
    return docs + extended + fillers * msl * msl


def measure_efficiency(
    lengths: np.ndarray,
    settings: BatchSettings,
    *,
    seed: int = 0,
    epoch: int = 0,
    trained: np.ndarray | None = None,
) -> Efficiency:
    """Packing efficiency and padding waste of a strategy for these sequence lengths."""
    plan = build_plan(
        lengths,
        trained=trained,
        strategy=settings.strategy,
        max_seq_len=settings.max_seq_len,
        tokens_per_step=settings.tokens_per_step,
        seed=seed,
        epoch=epoch,
    )
    return plan_efficiency(plan, settings, lengths=lengths)
