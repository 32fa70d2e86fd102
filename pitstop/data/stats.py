"""Length statistics of a prepared dataset, and the table `pitstop prepare` prints.

Everything is computed from `LengthCounts`: how many documents (or sequences) have each
length. `prepare` adds each chunk's lengths as it writes them, so its memory holds the
distinct lengths, never a number per document (issue 32: the same at 10M documents as at
0.1M), and the statistics cost milliseconds at any size. `pack_efficiency` runs
best-fit-decreasing packing by length counts (`pitstop.core.packing.bfd_bin_count`), exactly
the bins item-by-item packing opens.
"""

from __future__ import annotations

from typing import Any, TypedDict

import numpy as np

from pitstop.core.packing import bfd_bin_count

CANDIDATES = (256, 512, 1024, 2048, 4096, 8192)

# `prepare` and `train` warn when this share of the records carry no loss target but their
# end-of-sequence token (`train` refuses when all do). Such a record teaches the model to
# end its answer right after the prompt, an empty reply, so 1% already pulls a model that
# way; below it, a stray empty conversation in a large set is noise a warning would make
# users learn to ignore, and the statistics still count it.
EOS_ONLY_WARN_SHARE = 0.01


class LengthCounts:
    """How many items have each length: sorted distinct `values` and their `counts`
    (int64). Memory grows with the distinct lengths, not the items."""

    def __init__(self, values: np.ndarray | None = None, counts: np.ndarray | None = None) -> None:
        self.values = np.zeros(0, np.int64) if values is None else np.asarray(values, np.int64)
        self.counts = np.zeros(0, np.int64) if counts is None else np.asarray(counts, np.int64)

    @classmethod
    def of(cls, lengths: LengthCounts | np.ndarray | list[int]) -> LengthCounts:
        """`lengths` counted (a LengthCounts is returned as it is)."""
        if isinstance(lengths, LengthCounts):
            return lengths
        values, counts = np.unique(np.asarray(lengths, dtype=np.int64), return_counts=True)
        return cls(values, counts)

    def add(self, lengths: np.ndarray) -> None:
        """Count a chunk's lengths in as well."""
        chunk = LengthCounts.of(lengths)
        values = np.concatenate([self.values, chunk.values])
        counts = np.concatenate([self.counts, chunk.counts])
        self.values, inverse = np.unique(values, return_inverse=True)
        self.counts = np.bincount(inverse, weights=counts).astype(np.int64)

    def __len__(self) -> int:
        return int(self.counts.sum())

    @property
    def total(self) -> int:
        return int((self.values * self.counts).sum())

    def max(self) -> int:
        return int(self.values[-1]) if len(self.values) else 0

    def mean(self) -> float:
        n = len(self)
        return self.total / n if n else 0.0

    def quantile(self, p: float) -> int:
        """`np.quantile(lengths, p, method="inverted_cdf")`: the smallest length with at
        least p of the items at or below it."""
        n = len(self)
        if n == 0:
            return 0
        at = np.cumsum(self.counts)
        return int(self.values[min(int(np.searchsorted(at, p * n, side="left")), len(at) - 1)])

    def share_at_most(self, limit: int) -> float:
        n = len(self)
        return float(self.counts[self.values <= limit].sum()) / n if n else 1.0

    def count_above(self, limit: int) -> int:
        return int(self.counts[self.values > limit].sum())


def pack_efficiency(
    lengths: LengthCounts | np.ndarray | list[int], max_len: int
) -> tuple[float, int]:
    """(filled fraction, rows) of best-fit-decreasing packing of `lengths` into rows of `max_len`.

    Lengths above `max_len` are split into full rows plus a remainder first, as
    `--long-docs split` does. The packing is the trainer's own (`pitstop.core.packing`).
    """
    lc = LengthCounts.of(lengths)
    keep = lc.values > 0
    values, counts = lc.values[keep], lc.counts[keep]
    if counts.sum() == 0:
        return 1.0, 0
    full = int(((values // max_len) * counts).sum())
    rest = values % max_len
    rows = full + bfd_bin_count(rest[rest > 0], counts[rest > 0], max_len)
    return float((values * counts).sum()) / (rows * max_len), rows


class PaddingWaste(TypedDict):
    """One row of the manifest's "padding_waste" table: documents padded to `max_len`."""

    max_len: int
    rows: int
    padding_fraction: float  # of the computed positions, rounded to 4 places
    docs_split: int  # documents longer than max_len, split into several rows


class Recommendation(TypedDict):
    """The manifest's "recommended_max_len": the max length `prepare` advises, and why."""

    value: int
    reason: str
    documents_whole: float
    padding_fraction: float
    packing_efficiency: float


def padding_waste(doc_lengths: LengthCounts | np.ndarray, max_len: int) -> PaddingWaste:
    """Rows and padding if every document were padded to `max_len` (long ones split into rows)."""
    lc = LengthCounts.of(doc_lengths)
    rows = int((np.maximum(1, -(-lc.values // max_len)) * lc.counts).sum())
    waste = 1 - lc.total / (rows * max_len) if rows else 0.0
    return PaddingWaste(
        max_len=max_len,
        rows=rows,
        padding_fraction=round(waste, 4),
        docs_split=lc.count_above(max_len),
    )


def compute_stats(
    doc_lengths: LengthCounts | np.ndarray,
    seq_lengths: LengthCounts | np.ndarray,
    *,
    max_seq_len: int,
    counts: dict[str, Any],
    model_max_len: int | None = None,
) -> dict[str, Any]:
    """The "stats" section of a store manifest (JSON-serialisable)."""
    d = LengthCounts.of(doc_lengths)
    dist = {
        "mean": round(d.mean(), 1),
        **{f"p{p}": d.quantile(p / 100) for p in (50, 90, 95, 99)},
        "max": d.max(),
    }
    lens = sorted({*CANDIDATES, max_seq_len})
    waste = [padding_waste(d, L) for L in lens]
    eff, rows = pack_efficiency(seq_lengths, max_seq_len)
    stats = {
        **counts,
        "document_length": dist,
        "max_seq_len": max_seq_len,
        "padding_waste": waste,
        "packing": {
            "max_len": max_seq_len,
            "rows": rows,
            "efficiency": round(eff, 4),
            "method": "best-fit decreasing",
        },
    }
    stats["recommended_max_len"] = recommend(d, dist["p99"], waste, model_max_len, max_seq_len)
    return stats


def recommend(
    d: LengthCounts | np.ndarray,
    p99: int,
    waste: list[PaddingWaste],
    model_max_len: int | None = None,
    current: int | None = None,
) -> Recommendation:
    """The max length to use: the smallest candidate holding 99% of documents whole, the
    run's own `current` length among the candidates (a shorter one that holds them is not
    lengthened to 256).

    Never above `model_max_len` (the positions the model was built for): past it a
    learned position table crashes and rotary positions are untrained.
    """
    by_len = {w["max_len"]: w for w in waste}
    # The model's own limit is a candidate too: the longest row it takes.
    given = [x for x in (current, model_max_len) if x]
    candidates = sorted({*CANDIDATES, *given})
    allowed = [c for c in candidates if model_max_len is None or c <= model_max_len]
    fits = [c for c in allowed if c >= p99]
    value = fits[0] if fits else allowed[-1]
    d = LengthCounts.of(d)
    whole = d.share_at_most(value)
    eff, _ = pack_efficiency(d, value)
    pad = (
        by_len[value]["padding_fraction"]
        if value in by_len
        else padding_waste(d, value)["padding_fraction"]
    )
    if fits and value == current:
        why = f"the length given, which holds 99% of documents whole (p99 = {p99} tokens)"
    elif fits:
        why = f"the smallest candidate that holds 99% of documents whole (p99 = {p99} tokens)"
    elif model_max_len is not None and allowed[-1] < candidates[-1]:
        why = (
            f"the longest the model takes ({model_max_len} positions in its config.json); p99 is "
            f"{p99} tokens, so long documents will be split"
        )
    else:
        why = f"the largest candidate; p99 is {p99} tokens, so long documents will be split"
    reason = (
        f"{value}: {why}; {whole:.1%} of documents fit whole. Padding every row to {value} would "
        f"waste {pad:.1%} of computed positions; packing (--batching pack) removes padding "
        f"waste and fills {eff:.1%} of rows at this length"
    )
    return Recommendation(
        value=value,
        reason=reason,
        documents_whole=round(whole, 4),
        padding_fraction=pad,
        packing_efficiency=round(eff, 4),
    )


def eos_only_cause(info: dict[str, Any], stats: dict[str, Any]) -> str:
    """The likely reasons records carry no target but their EOS, by record shape."""
    by_kind = info.get("by_kind") or {}
    unknown = not by_kind  # a store from before shapes were counted: name every cause
    causes = []
    if by_kind.get("chat") or unknown:
        n = f" in {by_kind['chat']:,} chat records" if by_kind.get("chat") else ""
        causes.append(
            f"no assistant turn found{n}: only assistant turns are loss targets (ShareGPT "
            '"from": "gpt", messages "role": "assistant"); check the role names and that '
            "--messages-field names the conversation, or pass --train-on-prompt to train on "
            "every turn"
        )
    if by_kind.get("text") or unknown:
        n = f"{by_kind['text']:,} " if by_kind.get("text") else ""
        causes.append(
            f"{n}text records are one token long: check that --text-field names the field "
            "that holds the text"
        )
    ld = stats.get("long_documents") or {}
    if ld.get("policy") == "truncate" and ld.get("targets_removed"):
        causes.append(
            f"--long-docs truncate removed {ld['targets_removed']:,} target tokens past "
            f"--max-seq-len {stats.get('max_seq_len')}; use --long-docs split (the default) "
            "or a longer --max-seq-len"
        )
    elif by_kind.get("prompt_completion") or by_kind.get("instruction"):
        causes.append(
            "prompt/completion or instruction records whose completion adds no token of its "
            "own: check --completion-field / --output-field"
        )
    return "; ".join(causes)


def eos_only_message(info: dict[str, Any] | None, stats: dict[str, Any]) -> str | None:
    """A warning when at least EOS_ONLY_WARN_SHARE of the records (`info`: the manifest's
    "eos_only_documents") carry no target but their EOS; None below it or when unknown."""
    if not info or not info.get("count") or not info.get("of"):
        return None
    n, of = int(info["count"]), int(info["of"])
    if n < of * EOS_ONLY_WARN_SHARE:
        return None
    head = (
        f"all {of:,} records carry" if n == of else f"{n:,} of {of:,} records ({n / of:.1%}) carry"
    )
    return (
        f"{head} no loss target but the end-of-sequence token, so they teach nothing but "
        f"to stop; likely cause: {eos_only_cause(info, stats)}"
    )


def slow_records_message(stats: dict[str, Any]) -> str | None:
    """A warning when records were skipped for --max-record-seconds; None when none were."""
    info = stats.get("slow_records") or {}
    n = int(info.get("count") or 0)
    if not n:
        return None
    first = (info.get("examples") or [{}])[0]
    where = f" (first: {first['where']}: {first['what']})" if first else ""
    return (
        f"{n:,} record{'s' if n > 1 else ''} skipped: still rendering after "
        f"{info.get('limit_seconds', 0):g} s (--max-record-seconds){where}; not in the store. "
        "A chat template that loops over the messages inside a loop over them is the usual "
        "cause: simplify it or split long conversations, or pass --max-record-seconds 0 to "
        "wait for them however long they take"
    )


def format_stats(stats: dict[str, Any]) -> str:
    """The human-readable table printed by `pitstop prepare`."""
    s = stats
    L = s.get("max_seq_len")
    lines = [
        f"documents        {s.get('documents', 0):>14,}",
        f"sequences        {s.get('sequences', 0):>14,}   (rows of at most {L} tokens)",
        f"tokens           {s.get('tokens', 0):>14,}",
        f"target tokens    {s.get('target_tokens', 0):>14,}   (carry loss; prompts and first tokens do not)",
    ]
    eos_only = (s.get("eos_only_documents") or {}).get("count")
    if eos_only:
        lines.append(
            f"EOS-only records {eos_only:>14,}   (no target but the end-of-sequence token)"
        )
    kinds = s.get("record_kinds") or {}
    if kinds:
        lines.append("record shapes    " + ", ".join(f"{k} {v:,}" for k, v in kinds.items()))
    bad = s.get("bad_records", 0)
    lines.append(f"bad records      {bad:>14,}   {'(skipped)' if bad else ''}".rstrip())
    for ex in s.get("bad_examples", [])[:10]:
        lines.append(f"    {ex['where']}: {ex['reason']}")
    slow = s.get("slow_records") or {}
    if slow.get("count"):
        lines.append(
            f"slow records     {slow['count']:>14,}   (skipped: still rendering after "
            f"{slow.get('limit_seconds', 0):g} s, --max-record-seconds)"
        )
        for ex in slow.get("examples", [])[:10]:
            lines.append(f"    {ex['where']}: {ex['what']}")
    dl = s.get("document_length", {})
    lines += [
        "",
        "document length (tokens, EOS included)",
        "  "
        + "  ".join(f"{k} {dl.get(k, 0):,}" for k in ("mean", "p50", "p90", "p95", "p99", "max")),
    ]
    ld = s.get("long_documents", {})
    if ld:
        pol, n = ld.get("policy"), ld.get("count", 0)
        msg = f"long documents (> {L} tokens): {n:,}"
        if n and pol == "split":
            msg += (
                f", split into {ld.get('extra_chunks', 0):,} extra sequences; "
                f"{ld.get('targets_lost', 0):,} target tokens lost at chunk starts"
            )
        elif n and pol == "truncate":
            msg += f", truncated: {ld.get('tokens_removed', 0):,} tokens removed"
        elif n and pol == "drop":
            msg += f", dropped: {ld.get('tokens_removed', 0):,} tokens removed"
        lines += ["", msg]
    lines += [
        "",
        "padding waste if every row were padded to max length",
        "  max_len        rows   padding   docs split",
    ]
    for w in s.get("padding_waste", []):
        mark = " <- --max-seq-len" if w["max_len"] == L else ""
        lines.append(
            f"  {w['max_len']:>7}  {w['rows']:>10,}   {w['padding_fraction']:>6.1%}   {w['docs_split']:>10,}{mark}"
        )
    pk = s.get("packing", {})
    if pk:
        lines += [
            "",
            f"packing into rows of {pk['max_len']} ({pk['method']}): {pk['rows']:,} rows, "
            f"{pk['efficiency']:.1%} of positions hold tokens",
        ]
    rec = s.get("recommended_max_len")
    if rec:
        lines += ["", f"recommended --max-seq-len {rec['reason']}"]
    if "prepare_seconds" in s:
        lines += [
            "",
            f"prepared in {s['prepare_seconds']:.1f} s ({s.get('tokens_per_second', 0):,.0f} tokens/s)",
        ]
    return "\n".join(lines)
