"""Padding-free decoding forwards: a step's rows are one packed sequence, attention runs per row.

The model sees ``[1, T]`` (all rows' real tokens), so only attention needs rows:
:func:`packed_sdpa`, registered under :data:`NAME`, runs SDPA per group of rows alike in width
and cache length (one-query AR rows share a call with padded keys), and the cache writes each
token to its row and slot (:class:`Packing`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from itertools import accumulate

import torch
from transformers import AttentionInterface

from .row_cache import RowKVCache

NAME = "wedlm_packed_sdpa"


@dataclass(frozen=True)
class RowGroup:
    """Rows ``first .. last - 1``: ``length`` new tokens each on ``cached``, from ``offset``."""

    first: int
    last: int
    length: int
    cached: int
    offset: int
    mask: torch.Tensor | None


@dataclass(frozen=True)
class Packing:
    """Where one forward's packed tokens go: ``row_of[t]``, ``slot_of[t]``, and the groups."""

    rows: int
    length: int  # new tokens per row when ``uniform``
    cached: int  # cache length of every row when ``uniform``
    uniform: bool
    end: int  # one past the last cache slot this forward writes
    row_of: torch.Tensor | None
    slot_of: torch.Tensor | None
    groups: tuple[RowGroup, ...]

    @classmethod
    def build(cls, lengths: list[int], cached: list[int], cache: RowKVCache, dtype: torch.dtype) -> "Packing":
        offsets = list(accumulate(lengths[:-1], initial=0))
        groups, first = [], 0
        for r in range(1, len(lengths) + 1):
            if r < len(lengths) and _same_call(lengths, cached, first, r):
                continue
            n, c = lengths[first], max(cached[first:r])
            if c != min(cached[first:r]):  # next-token rows on caches of different lengths: keys padded
                mask = _key_padding_mask(cached[first:r], c + 1, dtype, cache.lengths.device)
            else:
                mask = cache.causal_mask(c, n, dtype) if c else None
            groups.append(RowGroup(first, r, n, c, offsets[first], mask))
            first = r
        uniform = len(set(zip(lengths, cached))) == 1  # every row writes the same slots
        row_of = slot_of = None
        if not uniform:
            device = cache.lengths.device
            counts = torch.tensor(lengths, device=device)
            row_of = torch.repeat_interleave(torch.arange(len(lengths), device=device), counts)
            starts = torch.tensor([c - o for c, o in zip(cached, offsets)], device=device)
            slot_of = torch.arange(sum(lengths), device=device) + starts[row_of]
        end = max(n + c for n, c in zip(lengths, cached))
        return cls(len(lengths), lengths[0], cached[0], uniform, end, row_of, slot_of, tuple(groups))


def _same_call(lengths: list[int], cached: list[int], first: int, r: int) -> bool:
    """Whether row ``r`` shares rows ``first .. r - 1``'s SDPA call."""
    if lengths[r] != lengths[first]:
        return False
    return cached[r] == cached[first] or (lengths[r] == 1 and cached[r] > 0 and cached[first] > 0)


def _key_padding_mask(cached: list[int], keys: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive ``[rows, 1, 1, keys]``: row ``b``'s query sees slots ``<= cached[b]``."""
    seen = torch.arange(keys, device=device)[None, :] <= torch.tensor(cached, device=device)[:, None]
    mask = torch.zeros(len(cached), keys, dtype=dtype, device=device)
    return mask.masked_fill_(~seen, torch.finfo(dtype).min)[:, None, None, :]


def packed_sdpa(module, query, key, value, attention_mask, *, wedlm_packing: Packing, scaling=None, **kwargs):
    """HF attention function: packed ``query`` ``[1, heads, T, dim]``, the cache's buffers."""
    heads, dim = query.shape[1], query.shape[-1]
    gqa = key.shape[1] != heads
    outs = []
    for g in wedlm_packing.groups:
        rows, n, keys = g.last - g.first, g.length, g.cached + g.length
        q = query[:, :, g.offset : g.offset + rows * n]
        if rows > 1:
            q = q[0].unflatten(1, (rows, n)).transpose(0, 1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, key[g.first : g.last, :, :keys], value[g.first : g.last, :, :keys],
            attn_mask=None if g.mask is None else g.mask.to(query.device),  # a device_map layer may sit elsewhere
            is_causal=g.mask is None, scale=scaling, enable_gqa=gqa,
        )  # [rows, heads, n, dim]
        outs.append(out if rows == 1 else out.transpose(0, 1).reshape(1, heads, rows * n, dim))
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)).transpose(1, 2), None


AttentionInterface.register(NAME, packed_sdpa)


@contextlib.contextmanager
def packed_attention(model):
    """Run ``model``'s (SDPA) attention through :func:`packed_sdpa` inside the block."""
    config = model.config
    original = config._attn_implementation
    if original != "sdpa":
        raise ValueError(f"packed batched decoding needs an sdpa model, this one uses {original!r}")
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = original


@contextlib.contextmanager
def plain_attention(model):
    """Plain SDPA again inside a :func:`packed_attention` block, for an ordinary forward."""
    config = model.config
    current = config._attn_implementation
    if current != NAME:
        yield
        return
    config._attn_implementation = "sdpa"
    try:
        yield
    finally:
        config._attn_implementation = current
