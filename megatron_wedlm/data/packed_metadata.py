"""Packed metadata: the tensor form of :class:`.attention_rule.AttentionMetadata` that Megatron
carries as ``attention_mask`` (int32 ``[B, 3, S]``: doc id, is-memory flag, block id; a fourth
row, the context-parallel slot order, makes it ``[B, 4, S]``). See :mod:`megatron_wedlm.model.attention`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .attention_rule import AttentionMetadata

__all__ = [
    "causal_packed_metadata",
    "pack_attention_metadata",
    "packed_slot_order",
    "unpack_attention_metadata",
]


def pack_attention_metadata(metadata: AttentionMetadata, slot_order: Tensor | None = None) -> Tensor:
    """``AttentionMetadata`` (``[S]`` or ``[B, S]``) -> int32 ``[B, 3, S]`` for ``attention_mask``.

    ``slot_order`` (context parallelism, :mod:`megatron_wedlm.model.context_parallel`): the
    physical slots in the order the CP ranks hold them, stored as a fourth row (``[B, 4, S]``);
    the first three rows stay the whole row's metadata in physical order.
    """
    meta = metadata.batched()
    rows = [meta.doc_ids.to(torch.int32), meta.is_memory.to(torch.int32), meta.block_ids.to(torch.int32)]
    if slot_order is not None:
        if slot_order.shape != (meta.seq_len,):
            raise ValueError(f"slot_order must be [S] = [{meta.seq_len}], got {tuple(slot_order.shape)}")
        rows.append(slot_order.to(device=meta.doc_ids.device, dtype=torch.int32).expand_as(rows[0]))
    return torch.stack(rows, dim=1).contiguous()


def unpack_attention_metadata(packed: Tensor) -> AttentionMetadata:
    if packed.dim() != 3 or packed.shape[1] not in (3, 4):
        raise ValueError(f"packed attention metadata must be [B, 3, S] (or [B, 4, S] under CP), got {tuple(packed.shape)}")
    return AttentionMetadata(doc_ids=packed[:, 0], is_memory=packed[:, 1].bool(), block_ids=packed[:, 2])


def packed_slot_order(packed: Tensor) -> Tensor | None:
    """The context-parallel slot order of packed metadata (``[S]`` int64), None without CP."""
    return packed[0, 3].long() if packed.shape[1] == 4 else None


def causal_packed_metadata(batch_size: int, seq_len: int, device: torch.device | str) -> Tensor:
    """Packed metadata of a plain causal LM row (one document, memory stream only)."""
    packed = torch.zeros(batch_size, 3, seq_len, dtype=torch.int32, device=device)
    packed[:, 1] = 1
    return packed
