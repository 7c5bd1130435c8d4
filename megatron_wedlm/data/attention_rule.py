"""The WeDLM attention rule of docs/method.md §2.3, written once (:func:`may_attend`), and every
form derived from it: the dense mask (CPU), FlexAttention's ``mask_mod`` and ``BlockMask`` (GPU),
the tile classes and the pair counts, so they agree bit for bit.

Per-slot metadata (:class:`AttentionMetadata`): ``doc_ids`` (-1: padding), ``is_memory`` and
``block_ids``; the physical slot index is implicit. Padding attends nothing unless
``padding_attends_self`` (softmax kernels turn an empty row into NaN). True = may attend;
Megatron-Core's ``attention_mask`` is the opposite, so pass ``~mask`` there.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

__all__ = [
    "AttentionMetadata",
    "TileClasses",
    "may_attend",
    "dense_attention_mask",
    "flex_mask_mod",
    "classify_tiles",
    "build_block_mask",
    "allowed_keys_per_query",
    "count_allowed_pairs",
    "allowed_pairs_per_query_tile",
]


def may_attend(
    q_doc: Tensor,
    q_is_memory: Tensor,
    q_block: Tensor,
    q_idx: Tensor,
    k_doc: Tensor,
    k_is_memory: Tensor,
    k_block: Tensor,
    k_idx: Tensor,
    padding_attends_self: bool = False,
) -> Tensor:
    """The WeDLM rule: may query slot q attend key slot k? Elementwise and branch-free, so it runs
    on broadcast grids (dense mask), under FlexAttention's ``vmap`` and inside compiled kernels."""
    causal = k_idx <= q_idx
    memory_to_memory = q_is_memory & k_is_memory & causal
    prediction_to_memory = ~q_is_memory & k_is_memory & (k_block < q_block)
    prediction_to_prediction = ~q_is_memory & ~k_is_memory & (k_block == q_block) & causal
    same_document = (q_doc == k_doc) & (q_doc >= 0)
    allowed = same_document & (memory_to_memory | prediction_to_memory | prediction_to_prediction)
    if padding_attends_self:
        allowed = allowed | ((q_doc < 0) & (q_idx == k_idx))
    return allowed


@dataclass
class AttentionMetadata:
    """What an attention module needs to apply the mask: tensors of one shape, ``[S]`` or
    ``[B, S]``, passed between pipeline stages instead of an ``S x S`` mask."""

    doc_ids: Tensor
    is_memory: Tensor
    block_ids: Tensor

    def __post_init__(self) -> None:
        shapes = {f.name: tuple(getattr(self, f.name).shape) for f in fields(self)}
        if len(set(shapes.values())) != 1:
            raise ValueError(f"AttentionMetadata tensors must share one shape, got {shapes}")
        if self.doc_ids.dim() not in (1, 2):
            raise ValueError(f"AttentionMetadata tensors must be [S] or [B, S], got {shapes['doc_ids']}")
        if self.is_memory.dtype != torch.bool:
            raise ValueError(f"is_memory must be a bool tensor, got {self.is_memory.dtype}")

    @property
    def seq_len(self) -> int:
        return self.doc_ids.shape[-1]

    def batched(self) -> "AttentionMetadata":
        """The same metadata with a leading batch dimension (``[1, S]`` if it was ``[S]``)."""
        if self.doc_ids.dim() == 2:
            return self
        return AttentionMetadata(*(getattr(self, f.name).unsqueeze(0) for f in fields(self)))

    def to(self, device: torch.device | str) -> "AttentionMetadata":
        return AttentionMetadata(*(getattr(self, f.name).to(device) for f in fields(self)))

    def as_dict(self) -> dict[str, Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, tensors: dict[str, Tensor]) -> "AttentionMetadata":
        return cls(**{f.name: tensors[f.name] for f in fields(cls)})


def dense_attention_mask(
    metadata: AttentionMetadata, padding_attends_self: bool = False, query_slots: Tensor | None = None
) -> Tensor:
    """Bool mask ``[S, S]`` (or ``[B, S, S]``), True = query (row) may attend key (column); O(S x S)
    memory, so for CPU and tests. ``query_slots`` picks the rows (a context-parallel rank's)."""
    k_slots = torch.arange(metadata.seq_len, device=metadata.doc_ids.device)
    q_slots = k_slots if query_slots is None else query_slots.to(k_slots.device)

    def q(t: Tensor) -> Tensor:  # query along rows
        return (t if query_slots is None else t.index_select(-1, q_slots)).unsqueeze(-1)

    def k(t: Tensor) -> Tensor:  # key along columns
        return t.unsqueeze(-2)

    return may_attend(
        q(metadata.doc_ids), q(metadata.is_memory), q(metadata.block_ids), q_slots.unsqueeze(-1),
        k(metadata.doc_ids), k(metadata.is_memory), k(metadata.block_ids), k_slots.unsqueeze(-2),
        padding_attends_self=padding_attends_self,
    )


def flex_mask_mod(
    metadata: AttentionMetadata, padding_attends_self: bool = False, query_slots: Tensor | None = None
) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """A FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` over ``[B, S]`` metadata on the attention's
    device; ``query_slots`` as in :func:`dense_attention_mask`."""
    meta = metadata.batched()
    doc, mem, blk = meta.doc_ids, meta.is_memory, meta.block_ids
    q_map = None if query_slots is None else query_slots.to(doc.device)

    def wedlm_mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        q = q_idx if q_map is None else q_map[q_idx]
        return may_attend(
            doc[b, q], mem[b, q], blk[b, q], q,
            doc[b, kv_idx], mem[b, kv_idx], blk[b, kv_idx], kv_idx,
            padding_attends_self=padding_attends_self,
        )

    return wedlm_mask_mod


@dataclass
class TileClasses:
    """The mask's ``T x T`` tiles as ``[B, n, n]`` bool grids: ``full`` (every pair allowed, no
    mask_mod), ``partial`` (some pair may be; the mask_mod decides); tiles in neither are skipped."""

    full: Tensor
    partial: Tensor
    tile_size: int


_BIG = torch.iinfo(torch.int64).max // 4


def _tile_summaries(meta: AttentionMetadata, tile: int) -> dict[str, Tensor]:
    """Per-tile min/max/any summaries of the metadata: all the classifier needs."""
    b, s = meta.doc_ids.shape
    shape = (b, s // tile, tile)
    doc = meta.doc_ids.reshape(shape).long()
    blk = meta.block_ids.reshape(shape).long()
    real = doc >= 0
    mem = meta.is_memory.reshape(shape) & real
    pred = ~meta.is_memory.reshape(shape) & real
    big = torch.full_like(doc, _BIG)

    def lo(values: Tensor, where: Tensor) -> Tensor:
        return torch.where(where, values, big).amin(-1)

    def hi(values: Tensor, where: Tensor) -> Tensor:
        return torch.where(where, values, -big).amax(-1)

    return {
        "has_real": real.any(-1),
        "all_real": real.all(-1),
        "doc_lo": lo(doc, real),
        "doc_hi": hi(doc, real),
        "has_mem": mem.any(-1),
        "has_pred": pred.any(-1),
        "mem_blk_lo": lo(blk, mem),
        "mem_blk_hi": hi(blk, mem),
        "pred_blk_lo": lo(blk, pred),
        "pred_blk_hi": hi(blk, pred),
    }


def classify_tiles(
    metadata: AttentionMetadata, tile_size: int = 128, padding_attends_self: bool = False
) -> TileClasses:
    """Classify the mask's tiles from per-tile summaries (no ``S x S`` tensor), the rule lifted to
    intervals: conservative at document and stream edges (never a wrong full or empty tile)."""
    meta = metadata.batched()
    s = meta.seq_len
    if tile_size < 1 or s % tile_size != 0:
        raise ValueError(
            f"sequence length {s} is not a multiple of tile_size {tile_size}; pad the row "
            f"(pad_to_multiple_of={tile_size}) before building a BlockMask"
        )
    t = _tile_summaries(meta, tile_size)
    q = {name: v.unsqueeze(-1) for name, v in t.items()}  # query tiles along rows
    k = {name: v.unsqueeze(-2) for name, v in t.items()}  # key tiles along columns
    n = s // tile_size
    qi = torch.arange(n, device=meta.doc_ids.device).view(n, 1)
    kj = torch.arange(n, device=meta.doc_ids.device).view(1, n)
    key_tile_all_before = kj * tile_size + tile_size - 1 <= qi * tile_size
    key_tile_some_before = kj <= qi

    one_doc = (
        q["all_real"] & k["all_real"]
        & (q["doc_lo"] == q["doc_hi"]) & (k["doc_lo"] == k["doc_hi"]) & (q["doc_lo"] == k["doc_lo"])
    )
    memory_queries_full = ~q["has_mem"] | (~k["has_pred"] & key_tile_all_before)
    pred_queries_see_all_memory = ~k["has_mem"] | (k["mem_blk_hi"] < q["pred_blk_lo"])
    pred_queries_see_all_pred = ~k["has_pred"] | (
        (q["pred_blk_lo"] == q["pred_blk_hi"])
        & (k["pred_blk_lo"] == k["pred_blk_hi"])
        & (q["pred_blk_lo"] == k["pred_blk_lo"])
        & key_tile_all_before
    )
    pred_queries_full = ~q["has_pred"] | (pred_queries_see_all_memory & pred_queries_see_all_pred)
    full = one_doc & memory_queries_full & pred_queries_full

    docs_overlap = (
        q["has_real"] & k["has_real"] & (q["doc_lo"] <= k["doc_hi"]) & (k["doc_lo"] <= q["doc_hi"])
    )
    some_memory_pair = q["has_mem"] & k["has_mem"] & key_tile_some_before
    some_pred_memory_pair = q["has_pred"] & k["has_mem"] & (k["mem_blk_lo"] < q["pred_blk_hi"])
    some_pred_pred_pair = (
        q["has_pred"] & k["has_pred"]
        & (k["pred_blk_lo"] <= q["pred_blk_hi"]) & (q["pred_blk_lo"] <= k["pred_blk_hi"])
        & key_tile_some_before
    )
    possible = docs_overlap & (some_memory_pair | some_pred_memory_pair | some_pred_pred_pair)
    if padding_attends_self:
        possible = possible | (~q["all_real"] & ~k["all_real"] & (qi == kj))
    return TileClasses(full=full, partial=possible & ~full, tile_size=tile_size)


def _ordered_indices(flags: Tensor) -> tuple[Tensor, Tensor]:
    """``[B, n, n]`` tile flags -> (count ``[B, 1, n]``, indices ``[B, 1, n, n]``) as BlockMask wants."""
    counts = flags.sum(-1, dtype=torch.int32)
    indices = torch.argsort((~flags).to(torch.uint8), dim=-1, stable=True).to(torch.int32)
    return counts.unsqueeze(1).contiguous(), indices.unsqueeze(1).contiguous()


def build_block_mask(
    metadata: AttentionMetadata, tile_size: int = 128, padding_attends_self: bool = False
):
    """FlexAttention ``BlockMask`` from :func:`classify_tiles`, without ``S x S`` memory. ``S``
    must be a multiple of ``tile_size`` (pad the batch), which keeps the kernel's reads in bounds."""
    meta = metadata.batched()
    tiles = classify_tiles(meta, tile_size, padding_attends_self)
    kv_num, kv_idx = _ordered_indices(tiles.partial)
    full_num, full_idx = _ordered_indices(tiles.full)
    s = meta.seq_len
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx,
        BLOCK_SIZE=tile_size,
        mask_mod=flex_mask_mod(meta, padding_attends_self),
        seq_lengths=(s, s),
    )


def allowed_keys_per_query(metadata: AttentionMetadata) -> Tensor:
    """How many keys each query slot may attend: int64 ``[B, S]`` (0 on padding), in O(S log S)
    time and O(S) memory, as differences of ``searchsorted`` positions among composite keys."""
    meta = metadata.batched()
    doc, memory = meta.doc_ids.long(), meta.is_memory
    block = meta.block_ids.long() - meta.block_ids.min().long()
    b, s = doc.shape
    valid = doc >= 0
    docs = int(doc.max()) + 2 if doc.numel() else 1
    blocks = int(block.max()) + 1 if block.numel() else 1
    if b * docs * blocks * s >= 2**62:  # composite keys would overflow int64: one row at a time
        return torch.cat([allowed_keys_per_query(AttentionMetadata(*(t[i] for t in (doc, memory, block))))
                          for i in range(b)])
    slot = torch.arange(s, device=doc.device).expand(b, s)
    group = torch.arange(b, device=doc.device).unsqueeze(-1) * docs + doc + 1  # (row, document)

    def members_between(members: Tensor, key: Tensor, low: Tensor, high: Tensor) -> Tensor:
        """For every slot, how many ``members`` have a ``key`` in [low, high] (the slot's bounds)."""
        keys = torch.sort(key[members]).values
        return torch.searchsorted(keys, high, right=True) - torch.searchsorted(keys, low)

    # memory -> memory: (row, document, slot) of memory slots, causal
    doc_slot = group * s + slot
    memory_keys = members_between(memory & valid, doc_slot, group * s, doc_slot)
    # prediction -> memory: (row, document, block) of memory slots, blocks before the query's
    doc_block = group * blocks + block
    earlier_memory = members_between(memory & valid, doc_block, group * blocks, doc_block - 1)
    # prediction -> prediction: (row, document, block, slot) of prediction slots, causal
    block_slot = doc_block * s + slot
    same_block = members_between(~memory & valid, block_slot, doc_block * s, block_slot)
    counts = torch.where(memory, memory_keys, earlier_memory + same_block)
    return torch.where(valid, counts, torch.zeros_like(counts))


def count_allowed_pairs(metadata: AttentionMetadata) -> Tensor:
    """Exact number of allowed (q, k) pairs per row (``[B]``): the attention FLOPs counted."""
    return allowed_keys_per_query(metadata).sum(-1)


def allowed_pairs_per_query_tile(metadata: AttentionMetadata, tile_size: int = 128) -> Tensor:
    """Allowed (q, k) pairs whose query lies in each ``tile_size`` tile of slots: int64
    ``[B, S / T]``, the attention work context parallelism balances across ranks."""
    keys = allowed_keys_per_query(metadata)
    b, s = keys.shape
    if s % tile_size:
        raise ValueError(f"{s} slots are not a whole number of tiles of {tile_size}")
    return keys.view(b, s // tile_size, tile_size).sum(-1)
