"""Core-attention modules that apply the WeDLM mask inside Megatron's ``SelfAttention``.

``GPTModel.forward``'s ``attention_mask`` reaches every layer unchanged (recomputation saves
it, so it is a tensor): here the packed metadata ``[B, 3, S]`` of
:class:`megatron_wedlm.data.AttentionMetadata` (``[B, 4, S]`` with the context-parallel slot
order), O(S) instead of an S x S mask, a Megatron bool mask (True = masked out), or None (plain
causal). :func:`layer_mask` normalises it into a :class:`LayerMask`; each backend (``dense``:
SDPA over tiles, ``flex``: a ``BlockMask``, ``te``: an arbitrary mask, refused under CP) expands
it once per micro-batch (cached). Under CP the dense and flex backends all-gather keys/values.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from megatron_wedlm.data.attention_rule import (
    AttentionMetadata,
    build_block_mask,
    dense_attention_mask,
    flex_mask_mod,
)
from megatron_wedlm.data.packed_metadata import causal_packed_metadata, packed_slot_order, unpack_attention_metadata

from .context_parallel import gather_along_sequence

__all__ = [
    "LayerMask",
    "WeDLMSDPAttention",
    "WeDLMFlexAttention",
    "layer_mask",
    "te_attention_class",
]


def _is_packed_metadata(mask: Tensor) -> bool:
    return mask.dim() == 3 and mask.shape[1] in (3, 4) and not mask.dtype.is_floating_point and mask.dtype != torch.bool


def _is_megatron_dense_mask(mask: Tensor) -> bool:
    return mask.dim() == 4 and mask.dtype == torch.bool and mask.shape[1] == 1


@dataclass(frozen=True)
class LayerMask:
    """A core attention's ``attention_mask`` as the backends read it: exactly one of ``packed``
    (int32 ``[B, 3|4, S]``) and ``masked_out`` (bool ``[B|1, 1, S, S]``, True = masked out).
    """

    packed: Tensor | None = None
    masked_out: Tensor | None = None

    @property
    def tensor(self) -> Tensor:
        return self.packed if self.packed is not None else self.masked_out  # type: ignore[return-value]

    @property
    def slot_order(self) -> Tensor | None:
        """The context-parallel slot order of packed metadata, else None."""
        return None if self.packed is None else packed_slot_order(self.packed)


def layer_mask(attention_mask: Tensor | None, query: Tensor) -> LayerMask:
    """What a layer received (packed metadata, a bool mask, or None: causal over ``query``'s
    row) as a :class:`LayerMask`.
    """
    if attention_mask is None:
        return LayerMask(packed=causal_packed_metadata(query.shape[1], query.shape[0], query.device))
    if _is_packed_metadata(attention_mask):
        return LayerMask(packed=attention_mask)
    if _is_megatron_dense_mask(attention_mask):
        return LayerMask(masked_out=attention_mask)
    raise ValueError(
        "WeDLM attention expects packed metadata [B, 3, S] (pack_attention_metadata) or a "
        f"Megatron bool mask [B, 1, S, S]; got {attention_mask.dtype} {tuple(attention_mask.shape)}"
    )


# --------------------------------------------------------------------------------------------
# Cache of expanded masks
# --------------------------------------------------------------------------------------------


class _ExpandedMaskCache:
    """Expanded masks keyed by the storage of the metadata they came from.

    Safe without comparing contents: an entry holds its metadata tensor (the storage cannot be
    reused) and the key includes the version counter (bumped by any in-place write).
    """

    def __init__(self, max_entries: int = 4) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple, tuple[Tensor, Any]] = OrderedDict()

    def get(self, kind: tuple, packed: Tensor, build: Callable[[], Any]) -> Any:
        key = (
            kind,
            str(packed.device),
            packed.untyped_storage().data_ptr(),
            packed.storage_offset(),
            tuple(packed.shape),
            tuple(packed.stride()),
            packed._version,
        )
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            return entry[1]
        with torch.no_grad():
            built = build()
        self._entries[key] = (packed, built)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return built

    def clear(self) -> None:
        self._entries.clear()


_MASK_CACHE = _ExpandedMaskCache()


def _check_shapes(query: Tensor, key: Tensor, allowed_shape: tuple[int, ...]) -> None:
    s_q, s_k = query.shape[0], key.shape[0]
    if allowed_shape[-2:] != (s_q, s_k):
        raise ValueError(
            f"attention mask covers {allowed_shape[-2]}x{allowed_shape[-1]} slots but the layer sees "
            f"{s_q} queries and {s_k} keys; the mask must describe the full physical row (2L per document)"
        )


class _WeDLMCoreAttentionBase(torch.nn.Module):
    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type=None,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        **_ignored: Any,
    ) -> None:
        super().__init__()
        self.config = config
        self.cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        if self.cp_group is None and config.context_parallel_size > 1:
            from megatron.core import parallel_state as ps

            self.cp_group = ps.get_context_parallel_group()
        self.layer_number = layer_number
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)

    def _inputs(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attention_bias: Tensor | None, packed_seq_params) -> tuple[LayerMask, Tensor, Tensor, Tensor | None]:
        """``(mask, keys, values, query_slots)`` of a forward (under CP: the whole row's keys)."""
        if attention_bias is not None:
            raise ValueError("WeDLM attention does not take an attention_bias")
        if packed_seq_params is not None:
            raise ValueError(
                "WeDLM attention does not use packed_seq_params (THD); documents are packed into "
                "rows and separated by the mask metadata instead"
            )
        mask = layer_mask(attention_mask, query)
        return (mask, *self._context_parallel(mask, key, value))

    def _context_parallel(self, mask: LayerMask, key: Tensor, value: Tensor):
        """``(keys, values, query_slots)``: the whole row's keys/values under CP, in physical order;
        unchanged without CP, ``query_slots`` then None (query i is slot i).
        """
        order = mask.slot_order
        cp_size = 1 if self.cp_group is None else self.cp_group.size()
        if order is None:
            if cp_size > 1:
                raise ValueError(
                    "context parallelism needs the slot order in the packed metadata ([B, 4, S]); "
                    "shard batches with megatron_wedlm.model.context_parallel.shard_batch"
                )
            return key, value, None
        local = key.shape[0]
        if local * cp_size != order.numel():
            raise ValueError(
                f"this rank holds {local} slots but the row has {order.numel()} over a context-parallel "
                f"group of {cp_size}; every rank must hold S / CP slots"
            )
        rank = 0 if self.cp_group is None else self.cp_group.rank()
        if cp_size > 1:
            physical = torch.argsort(order).to(key.device)
            key = gather_along_sequence(key, self.cp_group).index_select(0, physical)
            value = gather_along_sequence(value, self.cp_group).index_select(0, physical)
        return key, value, order[rank * local:(rank + 1) * local]

    @staticmethod
    def _to_bhsd(x: Tensor) -> Tensor:
        return x.permute(1, 2, 0, 3)  # [s, b, h, d] -> [b, h, s, d]

    @staticmethod
    def _to_sbh(x: Tensor) -> Tensor:
        b, h, s, d = x.shape
        return x.permute(2, 0, 1, 3).reshape(s, b, h * d)  # -> [s, b, h*d]


@dataclass
class _QueryTile:
    """One query tile of the dense plan: its rows, the key slots it needs, its mask."""

    start: int
    end: int
    keys: slice | Tensor  # a slice when the needed key tiles are contiguous, else slot indices
    allowed: Tensor  # [B|1, 1, end - start, num_keys] bool, True = may attend


def _key_runs(columns: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for c in columns:
        if runs and runs[-1][1] == c:
            runs[-1] = (runs[-1][0], c + 1)
        else:
            runs.append((c, c + 1))
    return runs


def _dense_plan(allowed: Tensor, tile: int) -> list[_QueryTile] | None:
    """Query tiles with only the key tiles they may attend (None: one SDPA call is as good);
    dropped keys are fully masked for the tile, so the softmax is unchanged.
    """
    b, _, s, s_k = allowed.shape
    if tile < 1 or s % tile or s_k % tile or s < 4 * tile:
        return None
    tiles = allowed.reshape(b, s // tile, tile, s_k // tile, tile).any(dim=2).any(dim=-1).any(dim=0)  # [n_q, n_k]
    if tiles.float().mean().item() > 0.75:
        return None
    plan = []
    for i, row in enumerate(tiles.tolist()):
        runs = _key_runs([j for j, used in enumerate(row) if used])
        rows = allowed[:, :, i * tile:(i + 1) * tile]
        if len(runs) == 1:
            keys: slice | Tensor = slice(runs[0][0] * tile, runs[0][1] * tile)
            sub = rows[..., keys]
        else:
            keys = torch.cat([torch.arange(a * tile, z * tile, device=allowed.device) for a, z in runs])
            sub = rows.index_select(-1, keys)
        plan.append(_QueryTile(i * tile, (i + 1) * tile, keys, sub.contiguous()))
    return plan


def _allowed_by_query_chunks(metadata: AttentionMetadata, query_slots: Tensor | None, rows: int = 512) -> Tensor:
    """The kernel-safe dense mask ``[B, S_q, S]``, ``rows`` queries at a time (bounds the peak)."""
    meta = metadata.batched()
    device = meta.doc_ids.device
    q_slots = torch.arange(meta.seq_len, device=device) if query_slots is None else query_slots
    out = torch.empty(meta.doc_ids.shape[0], q_slots.numel(), meta.seq_len, dtype=torch.bool, device=device)
    for start in range(0, q_slots.numel(), rows):
        chunk = q_slots[start:start + rows]
        out[:, start:start + chunk.numel()] = dense_attention_mask(meta, padding_attends_self=True, query_slots=chunk)
    return out


def _allowed_mask(mask: LayerMask, query_slots: Tensor | None = None) -> Tensor:
    """Bool ``[B|1, 1, S_q, S]``, True = may attend."""
    if mask.masked_out is not None:
        return ~mask.masked_out
    return _allowed_by_query_chunks(unpack_attention_metadata(mask.packed), query_slots).unsqueeze(1)


def _dense_mask_and_plan(mask: LayerMask, query: Tensor, tile: int, query_slots: Tensor | None = None):
    """``(allowed [B|1, 1, S_q, S], plan or None)``, cached per micro-batch; ``query_slots``: the
    queries' physical slots under CP (None: query i is slot i).
    """

    def build():
        allowed = _allowed_mask(mask, query_slots)
        return allowed, _dense_plan(allowed, tile)

    first_query = -1 if query_slots is None else int(query_slots[0])
    return _MASK_CACHE.get(("dense-plan", tile, query.shape[0], first_query), mask.tensor, build)


class WeDLMSDPAttention(_WeDLMCoreAttentionBase):
    """Dense backend: SDPA with the bool WeDLM mask by query tiles of ``tile_size`` (0: one)."""

    def __init__(self, config, layer_number: int, *args: Any, tile_size: int, **kwargs: Any) -> None:
        super().__init__(config, layer_number, *args, **kwargs)
        if tile_size < 0:
            raise ValueError(f"dense tile_size must be >= 0 (0 = no tiling), got {tile_size}")
        self.tile_size = tile_size

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type=None,
        attention_bias: Tensor | None = None,
        packed_seq_params=None,
    ) -> Tensor:
        mask, key, value, query_slots = self._inputs(
            query, key, value, attention_mask, attention_bias, packed_seq_params
        )
        allowed, plan = _dense_mask_and_plan(mask, query, self.tile_size, query_slots)
        _check_shapes(query, key, tuple(allowed.shape))
        q, k, v = self._to_bhsd(query), self._to_bhsd(key), self._to_bhsd(value)
        dropout_p = self.dropout_p if self.training else 0.0
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            from megatron.core import tensor_parallel

            # Heads differ per TP rank, so dropout draws from the model-parallel RNG (as Megatron).
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = self._attend(q, k, v, allowed, plan, dropout_p)
        else:
            out = self._attend(q, k, v, allowed, plan, dropout_p)
        return self._to_sbh(out)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, plan, dropout_p: float) -> Tensor:
        if plan is None:
            return self._sdpa(q, k, v, allowed, dropout_p)
        outs = []
        for t in plan:
            if isinstance(t.keys, slice):
                k_t, v_t = k[:, :, t.keys], v[:, :, t.keys]
            else:
                k_t, v_t = k.index_select(2, t.keys), v.index_select(2, t.keys)
            outs.append(self._sdpa(q[:, :, t.start:t.end], k_t, v_t, t.allowed, dropout_p))
        return torch.cat(outs, dim=2)

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, dropout_p: float) -> Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, dropout_p=dropout_p, scale=self.softmax_scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )


_COMPILED_FLEX: Callable | None = None


def _flex_kernel(compile_kernel: bool) -> Callable:
    """FlexAttention, compiled once per process when asked."""
    global _COMPILED_FLEX
    if not compile_kernel:
        return flex_attention
    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX


class WeDLMFlexAttention(_WeDLMCoreAttentionBase):
    """FlexAttention backend over the WeDLM ``BlockMask``; params ``tile_size`` (the row length
    must be a multiple of it) and ``compile_kernel`` (None: compile on CUDA).
    """

    def __init__(self, config, layer_number: int, *args: Any, tile_size: int, compile_kernel: bool | None,
                 **kwargs: Any) -> None:
        super().__init__(config, layer_number, *args, **kwargs)
        if self.dropout_p and self.dropout_p > 0:
            raise ValueError("the flex backend has no attention dropout; set attention_dropout=0.0")
        if tile_size < 1:
            raise ValueError(f"flex tile_size must be >= 1, got {tile_size}")
        self.tile_size, self.compile_kernel = tile_size, compile_kernel

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type=None,
        attention_bias: Tensor | None = None,
        packed_seq_params=None,
    ) -> Tensor:
        mask, key, value, query_slots = self._inputs(
            query, key, value, attention_mask, attention_bias, packed_seq_params
        )
        if mask.packed is None:
            raise ValueError(
                "the flex backend needs packed metadata [B, 3, S] (pack_attention_metadata), not a dense mask"
            )
        packed = mask.packed
        if packed.shape[-1] != key.shape[0]:
            raise ValueError(f"metadata covers {packed.shape[-1]} slots, the layer sees {key.shape[0]} keys")
        tile = self.tile_size
        if query_slots is None:
            block_mask = _MASK_CACHE.get(
                ("flex", tile),
                packed,
                lambda: build_block_mask(unpack_attention_metadata(packed), tile, padding_attends_self=True),
            )
        else:
            block_mask = _MASK_CACHE.get(
                ("flex-cp", tile, int(query_slots[0])),
                packed,
                lambda: _context_parallel_block_mask(packed, query_slots, tile),
            )
        compile_kernel = self.compile_kernel if self.compile_kernel is not None else query.is_cuda
        kernel = _flex_kernel(compile_kernel)
        q, k, v = self._to_bhsd(query), self._to_bhsd(key), self._to_bhsd(value)
        out = kernel(q, k, v, block_mask=block_mask, scale=self.softmax_scale, enable_gqa=q.shape[1] != k.shape[1])
        return self._to_sbh(out)


def _context_parallel_block_mask(attention_mask: Tensor, query_slots: Tensor, tile: int):
    """BlockMask of this rank's queries x the whole row's keys, from the rule's ``mask_mod``."""
    meta = unpack_attention_metadata(attention_mask)
    mask_mod = flex_mask_mod(meta, padding_attends_self=True, query_slots=query_slots)
    return create_block_mask(
        mask_mod, meta.doc_ids.shape[0], None, query_slots.numel(), meta.seq_len,
        device=attention_mask.device, BLOCK_SIZE=tile,
    )


def te_attention_class() -> type:
    """Transformer Engine core attention, the WeDLM mask as TE's ``arbitrary`` mask (CUDA only)."""
    try:
        import transformer_engine  # noqa: F401
        from megatron.core.extensions.transformer_engine import TEDotProductAttention
    except ImportError as err:  # pragma: no cover - no TE on CPU machines
        raise ImportError(
            "attention_backend='te' needs Transformer Engine (pip install transformer-engine[pytorch]) "
            "on a CUDA machine; use attention_backend='flex' or 'dense' otherwise"
        ) from err
    from megatron.core.transformer.enums import AttnMaskType

    class WeDLMTEAttention(TEDotProductAttention):  # pragma: no cover - needs TE
        def __init__(self, config, layer_number, attn_mask_type, attention_type, **kwargs: Any) -> None:
            if config.context_parallel_size != 1:
                raise ValueError(
                    "attention_backend='te' does not support context parallelism for WeDLM rows "
                    "(TE's CP kernels take a causal/padding mask, not the dual-stream mask); use "
                    "attention_backend='flex' or 'dense' with parallelism.cp > 1"
                )
            super().__init__(config, layer_number, AttnMaskType.arbitrary, attention_type, **kwargs)

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None, **kwargs):
            if packed_seq_params is not None:
                raise ValueError("WeDLM attention does not use packed_seq_params (THD)")
            mask = layer_mask(attention_mask, query)
            masked_out = mask.masked_out
            if masked_out is None:
                masked_out = _MASK_CACHE.get(("te",), mask.packed, lambda: ~_allowed_mask(mask))
            _check_shapes(query, key, tuple(masked_out.shape))
            return super().forward(
                query, key, value, masked_out, attn_mask_type=AttnMaskType.arbitrary,
                attention_bias=attention_bias, packed_seq_params=None, **kwargs,
            )

    return WeDLMTEAttention
