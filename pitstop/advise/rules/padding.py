"""Rules about padding, packing, the maximum length and truncation."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from pitstop.advise.facts import random_batch_padding
from pitstop.advise.finding import Finding
from pitstop.advise.rules.context import Context, lora_rank, pct, rule
from pitstop.advise.setup import UNKNOWN

PADDING_LIMIT = 0.10  # padding waste worth acting on
TRUNCATION_LIMIT = 0.01  # share of tokens cut off worth reporting
MAX_LEN_OVER_P99 = 2.0  # "far above p99"


def _padding(ctx: Context) -> tuple[float, str] | None:
    """(padding fraction, how it was computed) for this setup on this data, or None."""
    d, s = ctx.data, ctx.setup
    if d is None or not s.batching_is_padded:
        return None
    if s.pads_to_max_len and s.max_len:
        row = d.padding_to(s.max_len)
        if row is None:
            return None
        return float(row["padding_fraction"]), f"every row padded to {s.max_len} tokens"
    if s.batching == "dynamic" and d.lengths is not None and s.micro_batch_rows:
        waste = random_batch_padding(d.lengths, s.micro_batch_rows, s.max_len)
        return waste, (
            f"random batches of {s.micro_batch_rows} rows padded to their longest row"
            + (f", rows cut at {s.max_len}" if s.max_len else "")
        )
    return None


# What packing, padding-free batches and length grouping do to the training math: the same
# tokens per epoch, but other documents share a step (tune -- tries them only when allowed).
BATCH_CHANGE = "changes which tokens form a step"


def _packing_fix(ctx: Context) -> str:
    s = ctx.setup
    if s.source == "pitstop":
        return (
            "--batching pack (or --batching auto, which times pack, bucket and pad on this model)"
        )
    if s.custom_loop:
        where = "the LightningDataModule's Dataset" if s.program == "lightning" else "the Dataset"
        return (
            "pack the rows: concatenate the tokenized documents (EOS between them) and cut "
            f"them into rows of the max length in {where}, or sort rows of similar "
            f"length into the same batch (a length-grouped sampler) ({BATCH_CHANGE})"
        )
    if s.hf_class == "SFTConfig":
        return (
            "padding_free=True (SFTConfig: each batch's rows are joined into one row with "
            "restarting position_ids, no pad computed; the same rows per step), or "
            "packing=True (with the default packing_strategy='bfd' TRL trains padding-free; "
            f"{BATCH_CHANGE}), or {s.group_by_length_fix} ({BATCH_CHANGE})"
        )
    return (
        f"{s.group_by_length_fix} (TrainingArguments; {BATCH_CHANGE}), or "
        "data_collator=DataCollatorWithFlattening() (no pad computed; the same rows per step), "
        "or train with TRL's SFTTrainer and SFTConfig(padding_free=True)"
    )


@rule("padding-waste")
def padding_waste(ctx: Context) -> Finding | None:
    """Padding computed from the data for a padded setup; a profile that measured it
    (`packing-off`) says it instead, from what was computed."""
    if _measured_padding(ctx) is not None:
        return None
    got = _padding(ctx)
    if got is None or got[0] < PADDING_LIMIT:
        return None
    waste, how = got
    return Finding(
        id="padding-waste",
        severity="high" if waste >= 0.3 else "medium",
        title=f"{pct(waste)} of computed positions are padding",
        evidence={
            "padding_fraction": round(waste, 4),
            "how": how,
            "batching": ctx.setup.batching,
            "max_len": ctx.setup.max_len,
            "store": ctx.data.store if ctx.data else None,
        },
        effect=f"packing computes {pct(waste)} fewer positions for the same tokens "
        "(attention per position also shrinks when rows get shorter)",
        basis="computed from the data",
        fix=_packing_fix(ctx),
        gain=waste,
    )


def _measured_padding(ctx: Context) -> float | None:
    """Padding share the profile measured (positions computed vs non-padding tokens), if any."""
    p = ctx.profile or {}
    seen, padded = p.get("seen_tokens"), p.get("padded_tokens")
    if isinstance(seen, (int, float)) and isinstance(padded, (int, float)) and padded > 0:
        return max(0.0, 1 - float(seen) / float(padded))
    return None


@rule("packing-off")
def packing_off(ctx: Context) -> Finding | None:
    """Fires only when the data cannot compute the waste (padding-waste does that), and only
    where padding exists: a measured share at or above the limit, or rows that can be padded
    (one row per dynamically padded batch has nothing to pad to)."""
    s = ctx.setup
    measured = _measured_padding(ctx)
    if measured is not None:  # what the run computed, whatever its collator: it decides
        return _measured_padding_finding(ctx, measured)
    if not s.batching_is_padded or ctx.data is not None:
        return None
    if s.source == "hf" and s.hf_class != "SFTConfig" and s.batching not in ("dynamic", UNKNOWN):
        return None
    if s.batching == "dynamic" and s.micro_batch_rows == 1:
        return None  # each batch is padded to its own longest (and only) row: no padding
    return Finding(
        id="packing-off",
        severity="low",
        title="sequences are padded, not packed (waste not measured: no data given)",
        evidence={
            "batching": s.batching,
            "max_len": s.max_len,
            "micro_batch_rows": s.micro_batch_rows,
        },
        effect="every padded position costs the same FLOPs as a real token; give the data "
        "(--data FILE_OR_STORE) to compute the waste",
        basis="FLOPs arithmetic",
        fix=_packing_fix(ctx),
    )


def _measured_padding_finding(ctx: Context, measured: float) -> Finding | None:
    if measured < PADDING_LIMIT:
        return None
    s, p = ctx.setup, ctx.profile or {}
    return Finding(
        id="packing-off",
        severity="high" if measured >= 0.3 else "medium",
        title=f"{pct(measured)} of computed positions were padding (measured)",
        evidence={
            "batching": s.batching,
            "max_len": s.max_len,
            "padding_fraction": round(measured, 4),
            "seen_tokens": p.get("seen_tokens"),
            "padded_tokens": p.get("padded_tokens"),
        },
        effect=f"{pct(measured)} of the positions the model computed were padding (the "
        "attention masks of the batches it trained on): padding-free or packed rows compute "
        f"{pct(measured)} fewer positions for the same tokens",
        basis="measured in this profile",
        fix=_packing_fix(ctx),
        gain=measured,
    )


@rule("max-len-above-p99")
def max_len_above_p99(ctx: Context) -> Finding | None:
    s, d = ctx.setup, ctx.data
    if d is None or not s.max_len or d.p99 is None or s.max_len < MAX_LEN_OVER_P99 * d.p99:
        return None
    rec = (d.stats.get("recommended_max_len") or {}).get("value")
    target = int(rec) if isinstance(rec, (int, float)) and rec < s.max_len else None
    if target is None:
        target = 1 << max(3, math.ceil(math.log2(d.p99)))  # the next power of two holding p99
    ev: dict[str, Any] = {"max_len": s.max_len, "p99": d.p99, "suggested": target}
    if s.packed and ctx.model is not None:
        fm = ctx.model.flops(lora_rank(ctx))  # the cost model's counts, LoRA-aware
        a, b = fm.per_token(s.max_len), fm.per_token(target)
        gain = 1 - b / a
        ev["flops_per_token"] = {str(s.max_len): a, str(target): b}
        effect = (
            f"packed rows of {target} instead of {s.max_len} cut attention FLOPs: {a:.3g} -> "
            f"{b:.3g} training FLOPs per token (6·N + 12·L·d·T), {pct(gain)} less"
        )
        basis = "FLOPs arithmetic"
    else:
        pad_now, pad_new = d.padding_to(s.max_len), d.padding_to(target)
        if s.pads_to_max_len and pad_now and pad_new:
            w0, w1 = float(pad_now["padding_fraction"]), float(pad_new["padding_fraction"])
            gain = 1 - (1 - w0) / (1 - w1) if w1 < 1 else 0.0
            ev["padding_fraction"] = {str(s.max_len): w0, str(target): w1}
            effect = (
                f"padding to {target} instead of {s.max_len}: padding {pct(w0)} -> {pct(w1)}, "
                f"{pct(gain)} fewer positions computed"
            )
            basis = "computed from the data"
        elif s.batching == "dynamic":
            gain = 0.0
            longest = (d.stats.get("document_length") or {}).get("max")
            held = f" (the longest document has {longest} tokens)" if longest else ""
            effect = (
                "batches are padded to their longest row, not to the max length, so a lower "
                f"max length saves nothing for rows shorter than it{held}; it only caps the rare "
                "long rows (memory) and cuts them (which changes what is learned)"
            )
            basis = "computed from the data"
        else:
            gain = 0.0
            effect = (
                "activation memory and attention cost per row grow with the row length; "
                "a shorter max length frees memory for larger micro-batches"
            )
            basis = "FLOPs arithmetic"
    key = s.max_len_key
    return Finding(
        id="max-len-above-p99",
        severity="medium"
        if gain >= 0.05 or (basis != "FLOPs arithmetic" and s.batching != "dynamic")
        else "low",
        title=f"max length {s.max_len} is {s.max_len / d.p99:.1f}x the data's p99 ({d.p99} tokens)",
        evidence=ev,
        effect=effect + f"; 99% of documents still fit whole in {target}",
        basis=basis,
        fix=s.fix(f"--max-seq-len {target}", f"{key}={target} (SFTConfig)"),
        gain=gain,
    )


@rule("truncation")
def truncation(ctx: Context) -> Finding | None:
    """Where documents are cut at the max length: TRL's SFTConfig (without packing), or
    pitstop's --long-docs truncate. pitstop's default splits long documents (no token lost)."""
    s, d = ctx.setup, ctx.data
    if d is None or not s.max_len:
        return None
    if s.source == "hf":
        cuts = s.hf_class == "SFTConfig" and not s.packed
    else:
        cuts = s.raw.get("long_docs") in ("truncate", "drop")
    share = d.truncated_share(s.max_len) if cuts else None
    if share is None or share < TRUNCATION_LIMIT:
        return None
    longest = int(np.max(d.doc_lengths)) if d.doc_lengths is not None else None
    return Finding(
        id="truncation",
        severity="medium" if share >= 0.05 else "low",
        title=f"{pct(share)} of the data's tokens lie beyond max length {s.max_len} and are never trained",
        evidence={
            "truncated_token_share": round(share, 4),
            "max_len": s.max_len,
            "longest_document": longest,
            "p99": d.p99,
        },
        effect="a cut document loses its tail: fewer tokens learned per epoch than the data holds "
        "(this changes what is learned; it is not a speed-up)",
        basis="computed from the data",
        fix=s.fix(
            "--long-docs split (the default: long documents become several rows, no token lost)",
            f"a larger {s.max_len_key} (the longest document has {longest} tokens), or split "
            "long documents into chunks of max length before training",
        ),
        gain=0.0,
    )
