"""Best-fit-decreasing (BFD) packing of sequences into rows of a fixed capacity.

Written by hand: the usual implementations (a sorted list of open bins searched per
item) cost O(n log n) Python operations, which is tens of seconds for a million
sequences. Lengths here are small integers (≤ max_seq_len), so this one groups
open bins by their *remaining capacity* and places every item of one length at
once: after a bin takes an item of length s it stays the best fit for the next
item of the same length until it has less than s left, so each bin absorbs
``remaining // s`` items in one step. Every bucket visit either empties a bucket
or finishes a length, so the loop runs O(distinct lengths + capacity) times and
the per-item work is vectorized numpy. The result is exactly BFD (ties between
bins with equal remaining capacity broken by bin age, ties between equal-length
items by the order given).
"""

from __future__ import annotations

from bisect import bisect_left, insort

import numpy as np

__all__ = ["best_fit_decreasing", "bfd_arrays", "bfd_bin_count"]


def _check(lengths: np.ndarray, capacity: int) -> None:
    if capacity < 1:
        raise ValueError(f"capacity must be at least 1, got {capacity}")
    if len(lengths) and (lengths.min() < 1 or lengths.max() > capacity):
        bad = int(lengths.min()) if lengths.min() < 1 else int(lengths.max())
        raise ValueError(f"every length must be between 1 and capacity {capacity}, got {bad}")


def bfd_arrays(
    lengths: np.ndarray, capacity: int, order: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """BFD on int lengths; returns ``(items, bounds)`` with bin b = ``items[bounds[b]:bounds[b+1]]``.

    Bins come in the order they were opened; inside a bin items are in decreasing
    length. ``order`` (a permutation of item indices) breaks ties between items of
    equal length: the planner passes a seeded shuffle so equal-length documents are
    grouped differently each epoch at exactly the same packing efficiency.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    _check(lengths, capacity)
    n = len(lengths)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(1, np.int64)
    if order is None:
        order = np.arange(n, dtype=np.int64)
    order = np.asarray(order, dtype=np.int64)
    order = order[np.argsort(-lengths[order], kind="stable")]
    sorted_len = lengths[order]
    group_starts = np.flatnonzero(np.r_[True, sorted_len[1:] != sorted_len[:-1]])
    group_ends = np.r_[group_starts[1:], n]

    bin_of = np.empty(n, dtype=np.int64)  # bin id of the item at each position of `order`
    buckets: dict[int, list[np.ndarray]] = {}  # remaining capacity -> ids of open bins
    keys: list[int] = []  # remaining capacities that have open bins, ascending
    n_bins = 0

    def add(r: int, bins: np.ndarray) -> None:
        if r <= 0 or len(bins) == 0:  # a full bin can take nothing more: forget it
            return
        if r not in buckets:
            buckets[r] = []
            insort(keys, r)
        buckets[r].append(bins)

    def take(r: int) -> np.ndarray:
        keys.remove(r)
        parts = buckets.pop(r)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    for start, end in zip(group_starts.tolist(), group_ends.tolist()):
        s = int(sorted_len[start])
        pos, left = start, end - start
        # 1. Existing bins, tightest first (the best fit is the smallest remaining >= s).
        while left:
            k = bisect_left(keys, s)
            if k == len(keys):
                break
            r = keys[k]
            bins = take(r)
            q = r // s  # items of length s each of these bins takes before another bin fits better
            full = min(len(bins), left // q)
            if full:
                bin_of[pos : pos + full * q] = np.repeat(bins[:full], q)
                pos, left = pos + full * q, left - full * q
                add(r - q * s, bins[:full])
            rest = bins[full:]
            if left and len(rest):  # fewer than q items left: the next bin takes them all
                bin_of[pos : pos + left] = rest[0]
                add(r - left * s, rest[:1])
                pos, left, rest = pos + left, 0, rest[1:]
            add(r, rest)
        # 2. New bins, each filled with `per_bin` items of length s.
        if left:
            per_bin = capacity // s
            m = -(-left // per_bin)
            ids = np.arange(n_bins, n_bins + m, dtype=np.int64)
            bin_of[pos : pos + left] = n_bins + np.arange(left) // per_bin
            n_bins += m
            add(capacity - per_bin * s, ids[:-1])
            add(capacity - (left - (m - 1) * per_bin) * s, ids[-1:])

    by_bin = np.argsort(bin_of, kind="stable")  # keeps decreasing length inside a bin
    items = order[by_bin]
    bounds = np.zeros(n_bins + 1, dtype=np.int64)
    np.cumsum(np.bincount(bin_of, minlength=n_bins), out=bounds[1:])
    return items, bounds


def best_fit_decreasing(lengths: list[int] | np.ndarray, capacity: int) -> list[list[int]]:
    """Pack items of the given lengths into as few bins of `capacity` as BFD finds.

    Returns the bins as lists of item indices (bins in opening order, items in
    decreasing length). Raises ValueError if a length is below 1 or above capacity.
    """
    items, bounds = bfd_arrays(np.asarray(lengths, dtype=np.int64), capacity)
    flat = items.tolist()
    b = bounds.tolist()
    return [flat[b[i] : b[i + 1]] for i in range(len(b) - 1)]


def bfd_bin_count(values: np.ndarray, counts: np.ndarray, capacity: int) -> int:
    """How many bins `bfd_arrays` opens for `counts[i]` items of length `values[i]`, in
    memory of the distinct lengths, not the items (prepare's statistics at any size).

    The same steps as `bfd_arrays` with each bucket holding a number of bins instead of
    their ids: which bin an item lands in never changes how many bins there are.
    """
    values = np.asarray(values, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    keep = counts > 0
    values, counts = values[keep], counts[keep]
    _check(values, capacity)
    buckets: dict[int, int] = {}  # remaining capacity -> open bins with it
    keys: list[int] = []  # remaining capacities that have open bins, ascending
    n_bins = 0

    def add(r: int, k: int) -> None:
        if r <= 0 or k <= 0:
            return
        if r not in buckets:
            buckets[r] = 0
            insort(keys, r)
        buckets[r] += k

    def take(r: int) -> int:
        keys.remove(r)
        return buckets.pop(r)

    order = np.argsort(-values, kind="stable")
    for s, left in zip(values[order].tolist(), counts[order].tolist()):
        while left:
            k = bisect_left(keys, s)
            if k == len(keys):
                break
            r = keys[k]
            bins = take(r)
            q = r // s
            full = min(bins, left // q)
            if full:
                left -= full * q
                add(r - q * s, full)
            rest = bins - full
            if left and rest:
                add(r - left * s, 1)
                left, rest = 0, rest - 1
            add(r, rest)
        if left:
            per_bin = capacity // s
            m = -(-left // per_bin)
            n_bins += m
            add(capacity - per_bin * s, m - 1)
            add(capacity - (left - (m - 1) * per_bin) * s, 1)
    return n_bins
