"""What a training forward trains, read from the model's own inputs: rows, positions, tokens.

A loop need not use a DataLoader (nanoGPT cuts its batches from a memmap with
`torch.randint`), and a DataLoader's batch need not be what the model trains (an evaluation
loop's fetch looks like any other). So `pitstop.watch` counts each optimizer step's tokens
from the arguments of the model's training forwards (`forward_counts`), whatever produced
them:

- the ids: the argument named `input_ids` (`idx`, `ids`, `tokens`, `x`, `input`), else the
  first integer tensor; a mapping argument holding `input_ids` (a batch handed to a
  LightningModule's `forward`) is read the same way;
- the targets: `labels` (Hugging Face's convention: the model shifts them by one, so a
  row's first position is never a target) or `targets` / `target` / `y` (nanoGPT's: already
  shifted); a negative value is an ignored position (-100 in Hugging Face and
  `F.cross_entropy`, -1 in nanoGPT). Without targets, every position after the first of a
  row that the attention mask keeps;
- the positions that are not padding: the attention mask's ones, else every position.

The counts stay on the device (summed when the run is written), so counting never syncs.
Written by hand: no library reads a training step's token counts off arbitrary forwards.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

IDS_NAMES = ("input_ids", "idx", "ids", "tokens", "x", "input", "inputs")
# Hugging Face models shift `labels` inside the forward; the other names are targets already.
SHIFTED_NAMES = ("labels",)
TARGET_NAMES = ("labels", "targets", "target", "y")
MASK_NAMES = ("attention_mask",)


@dataclass
class ForwardCounts:
    """One forward's counts (ints, or 0-d tensors left on the device until summed)."""

    rows: int
    positions: int
    seen: Any  # positions the attention mask keeps (all of them without a mask)
    targets: Any  # positions that carry a loss


def _int_tensor(x: Any) -> bool:
    import torch

    return isinstance(x, torch.Tensor) and not x.is_floating_point() and x.dim() >= 1


def _named_arguments(
    forward: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> dict[str, object]:
    """The forward's arguments by parameter name (positional ones bound to their names)."""
    try:
        bound = inspect.signature(forward).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):  # a builtin or an odd signature: keywords only
        return dict(kwargs)
    out = dict(bound.arguments)
    extra = out.pop("kwargs", None)
    if isinstance(extra, dict):
        out.update(extra)
    return out


def _pick(named: Mapping[str, Any], names: tuple[str, ...]) -> tuple[str, Any] | None:
    for n in names:
        if _int_tensor(named.get(n)):
            return n, named[n]
    return None


def _from_mapping(named: Mapping[str, Any]) -> ForwardCounts | None:
    """Counts from arguments addressed by name (a forward's keywords, or a batch mapping)."""
    ids = _pick(named, IDS_NAMES)
    if ids is None:
        return None
    target = _pick(named, TARGET_NAMES)
    mask = _pick(named, MASK_NAMES)
    return _counts(ids[1], target, mask[1] if mask else None)


def _counts(ids: Any, target: tuple[str, Any] | None, mask: Any) -> ForwardCounts | None:
    if ids.dim() > 2:
        return None  # not token ids (images, features): nothing to count as tokens
    rows = int(ids.shape[0]) if ids.dim() == 2 else 1
    positions = int(ids.numel())
    seen: Any = mask.sum() if mask is not None and mask.shape == ids.shape else positions
    if target is not None and target[1].shape[:1] == ids.shape[:1]:
        name, t = target
        if name in SHIFTED_NAMES:
            t = t[..., 1:]  # the model shifts labels by one: a row's first is never a target
        trained: Any = t.ge(0).sum()
    elif mask is not None and mask.shape == ids.shape:
        trained = mask[..., 1:].sum()
    else:
        trained = positions - rows if ids.dim() == 2 else max(positions - 1, 0)
    return ForwardCounts(rows=rows, positions=positions, seen=seen, targets=trained)


def forward_counts(
    module: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> ForwardCounts | None:
    """The counts of one training forward of `module` called with `args` / `kwargs`, or None
    when its inputs hold no token ids."""
    named = _named_arguments(getattr(module, "forward", module), args, kwargs)
    got = _from_mapping(named)
    if got is not None:
        return got
    for value in (*args, *kwargs.values()):  # a batch passed whole: a mapping or a tuple
        if isinstance(value, Mapping):
            got = _from_mapping(value)
            if got is not None:
                return got
        elif isinstance(value, (tuple, list)):
            got = _from_sequence(value)
            if got is not None:
                return got
    return _from_sequence(args)


def _from_sequence(values: Any) -> ForwardCounts | None:
    """The first integer tensor is the ids, a second of the same shape the targets (already
    shifted, as `model(X, Y)` takes them)."""
    tensors = [v for v in values if _int_tensor(v)]
    if not tensors:
        return None
    ids = tensors[0]
    target = None
    if len(tensors) > 1 and tensors[1].shape == ids.shape:
        target = ("targets", tensors[1])
    return _counts(ids, target, None)


def batch_counts(batch: Any) -> ForwardCounts | None:
    """The counts of a DataLoader batch: a mapping with `input_ids` (and `labels`,
    `attention_mask`), a tuple whose first integer tensor is the ids and second of the same
    shape the targets, or a bare tensor of ids."""
    if isinstance(batch, Mapping) or hasattr(batch, "keys"):
        try:
            return _from_mapping(dict(batch))
        except (TypeError, ValueError):
            return None
    if _int_tensor(batch):
        return _counts(batch, None, None)
    if isinstance(batch, (tuple, list)):
        return _from_sequence(batch)
    return None


def add_counts(into: MutableMapping[str, Any], counts: ForwardCounts) -> None:
    """Add `counts` to a step's tallies {"rows", "positions", "seen": [...], "targets": [...]}."""
    into["rows"] += counts.rows
    into["positions"] += counts.positions
    into["seen"].append(counts.seen)
    into["targets"].append(counts.targets)
