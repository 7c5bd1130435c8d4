"""Dual-stream WeDLM training data and the WeDLM attention-mask rule (docs/method.md §2).

:mod:`.row_format` (how a row is built, one frozen object), :mod:`.dual_stream` (rows and their
collation), :mod:`.attention_rule` (the rule, written once, and its forms), :mod:`.packed_metadata`
(the metadata as Megatron's ``attention_mask`` tensor), :mod:`.packing` (the one cutting rule),
:mod:`.seeding` (per-rank mask streams).

Mask convention everywhere: True = may attend; Megatron-Core's ``attention_mask`` is the opposite.
The names below are imported on first use (PEP 562): ``tools/prepare_data.py`` and its workers
need no torch, whose import is most of their start-up.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
    from .row_format import RowFormat
    from .seeding import rank_generator, rank_seed

_WHERE = {  # exported name -> the module that defines it
    "AttentionMetadata": "attention_rule",
    "TileClasses": "attention_rule",
    "build_block_mask": "attention_rule",
    "classify_tiles": "attention_rule",
    "allowed_keys_per_query": "attention_rule",
    "count_allowed_pairs": "attention_rule",
    "dense_attention_mask": "attention_rule",
    "flex_mask_mod": "attention_rule",
    "may_attend": "attention_rule",
    "IGNORE_INDEX": "dual_stream",
    "DualStreamBatch": "dual_stream",
    "build_dual_stream_batch": "dual_stream",
    "pad_dual_stream_batch": "dual_stream",
    "stack_dual_stream_batches": "dual_stream",
    "causal_packed_metadata": "packed_metadata",
    "pack_attention_metadata": "packed_metadata",
    "packed_slot_order": "packed_metadata",
    "unpack_attention_metadata": "packed_metadata",
    "PackedRow": "packing",
    "pack_documents_into_rows": "packing",
    "RowFormat": "row_format",
    "rank_generator": "seeding",
    "rank_seed": "seeding",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AttentionMetadata",
    "DualStreamBatch",
    "IGNORE_INDEX",
    "PackedRow",
    "RowFormat",
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
