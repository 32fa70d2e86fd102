"""What the forward needs, beyond input_ids and position_ids, to keep packed documents apart.

Each backend sees the same packed micro-batch ([B, T], position_ids restarting at 0 at every
document) and needs something different (checked against transformers 5.23's source):

- sdpa, eager: nothing. With ``attention_mask=None`` transformers derives each row's
  documents from the position restarts (``masking_utils.find_packed_sequence_indices``) and
  builds a dense [B, 1, T, T] document-causal mask.
- flex_attention: nothing. The same detection builds a ``BlockMask`` instead (block-sparse:
  blocks no query may see are skipped, and no dense mask exists).
- flash_attention_2: the varlen kwargs. Its kernel takes no mask: transformers infers
  document boundaries from position_ids only when B == 1
  (``modeling_flash_attention_utils._is_packed_sequence``); for B > 1 it runs plain causal
  attention over each whole row, and packed documents would attend to each other. Given
  ``cu_seq_lens_q/k`` (int32 [n_docs + 1], offsets into the flattened [B*T] tokens) and
  ``max_length_q/k`` (int), it runs ``flash_attn_varlen_func`` over every document of every
  row, as ``DataCollatorWithFlattening`` does for one row.

- sdpa_docs (pitstop's, train/doc_attention.py): the same varlen kwargs; it runs causal
  SDPA over each document's span, so a packed row costs the sum of its documents' squares.

Other backends never receive the varlen kwargs: they cannot use them.
"""

from __future__ import annotations

from typing import Any

import torch

from pitstop.batching.records import MicroBatch

# Backends whose kernel reads document boundaries from the varlen kwargs: flash-attn's
# varlen path, and pitstop's per-document SDPA (train/doc_attention.py).
VARLEN_ATTENTION = frozenset({"flash_attention_2", "sdpa_docs"})
# Backends whose kernel reads the offsets on the device (flash-attn's varlen kernel).
_DEVICE_OFFSETS = frozenset({"flash_attention_2"})
VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
# What the training forward passes beyond input_ids and position_ids (forward.forward_kwargs).
FORWARD_KEYS = (*VARLEN_KEYS, "attention_mask")


def boundaries_only_mask(batch_size: int) -> torch.Tensor:
    """sdpa_docs' training-forward `attention_mask`: an empty [B, 1, 0, 0] host tensor.

    With no mask and position ids, transformers looks for packed documents itself
    (``masking_utils.find_packed_sequence_indices``) and reads the answer on the host: one
    device sync per forward on a GPU, for a mask sdpa_docs never uses. A 4-d mask is taken
    as already built and handed to the layers untouched, so this empty one costs nothing,
    and sdpa_docs reads it as "documents from cu_seq_lens_q" (`is_boundaries_only`). It
    stays on the host even for a GPU run: only its shape is ever read. Any other kernel
    would misread it: it is passed to sdpa_docs only."""
    return torch.empty((batch_size, 1, 0, 0), dtype=torch.bool)


def is_boundaries_only(mask: Any) -> bool:
    """Whether `mask` is `boundaries_only_mask`'s marker."""
    return isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[-1] == 0


def doc_boundaries(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(cu_seqlens int32 [n_docs + 1], longest document) of a packed [B, T] batch.

    A document starts at every row start and wherever a position does not continue the one
    before it (the rule transformers applies to detect packing), so right padding that
    continues the last document's positions stays inside it, as collate makes it.
    """
    B, T = position_ids.shape
    starts = torch.ones(B, T, dtype=torch.bool, device=position_ids.device)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    flat = starts.flatten().nonzero().flatten()  # [n_docs] offsets into [B*T]
    end = torch.tensor([B * T], device=flat.device)
    cu = torch.cat([flat, end]).to(torch.int32)
    return cu, int(cu.diff().max())


def attention_kwargs(
    mb: MicroBatch, attention: str, device: torch.device
) -> dict[str, torch.Tensor | int]:
    """The extra forward kwargs `attention` needs for micro-batch `mb`, on `device` ({} if none).

    Uses the loader's ``cu_seqlens`` / ``max_seqlen`` (batching/collate.py computes them per
    packed row); a loader without them gets them derived from ``position_ids``.
    """
    if attention not in VARLEN_ATTENTION:
        return {}
    if "cu_seqlens" in mb and "max_seqlen" in mb:
        cu, longest = mb["cu_seqlens"], int(mb["max_seqlen"])
    else:
        cu, longest = doc_boundaries(mb["position_ids"])
    # Python ints, not tensors: flash-attn takes max_seqlen as an int, and a tensor would
    # cost a device-to-host sync per layer to read it.
    # sdpa_docs reads the offsets on the host (to group documents by length): kept there,
    # so a GPU run pays no device-to-host copy per layer for them.
    host = attention not in _DEVICE_OFFSETS
    cu = cu.to("cpu" if host else device, dtype=torch.int32, non_blocking=device.type == "cuda")
    kwargs: dict[str, torch.Tensor | int] = {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
    }
    if host:  # sdpa_docs: no packed-row detection (and its sync) in transformers
        kwargs["attention_mask"] = boundaries_only_mask(int(mb["position_ids"].shape[0]))
        # Under torch.compile the number of documents is a dynamic size from the first
        # graph on, not a new graph per layout (train/doc_op.py); eager runs ignore it.
        torch._dynamo.maybe_mark_dynamic(cu, 0)
    return kwargs
