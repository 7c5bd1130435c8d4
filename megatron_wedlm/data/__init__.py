"""Dual-stream WeDLM training data and the WeDLM attention-mask rule (docs/method.md §2).

* :mod:`.dual_stream`    -- ``build_dual_stream_batch`` -> :class:`DualStreamBatch` (one packed
  row), ``stack_dual_stream_batches`` (collate to ``[B, S]``), ``pad_dual_stream_batch``.
* :mod:`.attention_rule` -- the rule :func:`may_attend`, written once, and its forms:
  dense bool mask, FlexAttention ``mask_mod`` / ``BlockMask`` (no ``S x S`` memory),
  :class:`AttentionMetadata` (what attention modules and pipeline stages carry).
* :mod:`.packed_metadata` -- ``pack_attention_metadata``: ``AttentionMetadata`` as the int32
  ``[B, 3, S]`` tensor Megatron carries as ``attention_mask`` (``[B, 4, S]`` under CP).
* :mod:`.packing`        -- ``pack_documents_into_rows``: cut documents at block-aligned
  points and pack rows under a length cap (``fill=True``, pretraining: rows are filled and a
  document continues in the next row; otherwise next-fit). ``next_piece_length`` is the one
  cutting rule, shared with the webdataset loader.
* :mod:`.seeding`        -- ``rank_generator(seed, dp_rank, step)``: per-rank mask streams.

Mask convention everywhere: True = may attend. Megatron-Core's ``attention_mask`` is the
opposite (True = masked out); invert before handing it over.
"""

from .attention_rule import (
    AttentionMetadata,
    TileClasses,
    build_block_mask,
    classify_tiles,
    allowed_keys_per_query,
    count_allowed_pairs,
    dense_attention_mask,
    flex_mask_mod,
    may_attend,
)
from .dual_stream import (
    IGNORE_INDEX,
    DualStreamBatch,
    build_dual_stream_batch,
    pad_dual_stream_batch,
    stack_dual_stream_batches,
)
from .packed_metadata import causal_packed_metadata, pack_attention_metadata, packed_slot_order, unpack_attention_metadata
from .packing import PackedRow, pack_documents_into_rows
from .seeding import rank_generator, rank_seed

__all__ = [
    "AttentionMetadata",
    "DualStreamBatch",
    "IGNORE_INDEX",
    "PackedRow",
    "TileClasses",
    "build_block_mask",
    "build_dual_stream_batch",
    "causal_packed_metadata",
    "classify_tiles",
    "allowed_keys_per_query",
    "count_allowed_pairs",
    "dense_attention_mask",
    "flex_mask_mod",
    "may_attend",
    "pack_attention_metadata",
    "pack_documents_into_rows",
    "packed_slot_order",
    "pad_dual_stream_batch",
    "rank_generator",
    "rank_seed",
    "stack_dual_stream_batches",
    "unpack_attention_metadata",
]
