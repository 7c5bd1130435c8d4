"""Padding-free decoding forwards: the rows of a step are one packed sequence, attention runs per row.

Rows of a batched decode carry windows of different widths (W..2W slots under the engine's
schedule) on top of caches of different lengths. Padding every row to the widest window and
the longest cache costs the padding too: in the projections, MLPs and norms (on a batch of
different prompts a large share of the slots; docs/results.md), and in attention, where a
short row would be scored against the longest row's keys.

So a step feeds the model one *packed* sequence ``[1, T]`` (all rows' real tokens, row after
row, each with its logical position id). The linear layers, norms and RoPE are per token and
see no padding. Only attention needs the row structure: :func:`packed_sdpa`, registered in
HF's attention registry under :data:`NAME`, runs SDPA for each row on that row's own queries
and its own cache length (rows alike in width and cache length share one call), and the
cache writes each packed token's keys/values to its row and slot (:class:`Packing`).

Why not pad neighbouring rows into one call: an SDPA call has a fixed cost whatever its size,
but on ``tools/bench_decode.py``'s batch the padding costs more than the calls it saves, even
when rows share a call only while their padded pairs cost less than a call
(docs/results.md has the figures). What removes the per-row calls without padding is a
variable-length kernel (flash-attention's ``varlen`` on a GPU). Next-token (AR) rows are the
exception: one query each, so neighbouring ones share one call with their keys padded to the
longest cache (a key-padding mask), which is how HF ``generate`` batches them too.

One row is the same path with one group, which is also what makes a single-row step cheap:

* the mask is no tensor built per step but a view of a band kept by the cache
  (:meth:`RowKVCache.causal_mask`); the prefill (nothing cached) uses SDPA's own causal mode;
* grouped-query attention is left to SDPA (``enable_gqa``) instead of HF's ``repeat_kv``,
  which copies the whole cache once per layer and step.
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
    """Consecutive rows ``first .. last - 1`` with ``length`` new tokens each on ``cached`` cached
    ones, packed from token ``offset`` on; ``mask`` is None when nothing is cached (plain causal)."""

    first: int
    last: int
    length: int
    cached: int
    offset: int
    mask: torch.Tensor | None


@dataclass(frozen=True)
class Packing:
    """Where the packed tokens of one forward go: row ``row_of[t]``, cache slot ``slot_of[t]``
    (None when every row writes the same slots, a plain slice), and the attention groups."""

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
        """Rows of ``lengths`` new tokens each, written after ``cached`` tokens of ``cache``."""
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
    """Whether row ``r`` joins the SDPA call of rows ``first .. r - 1``: the same width and cache
    length, or one query each on a cache (an AR row: its keys padded to the longest cache cost
    less than a call of its own)."""
    if lengths[r] != lengths[first]:
        return False
    return cached[r] == cached[first] or (lengths[r] == 1 and cached[r] > 0 and cached[first] > 0)


def _key_padding_mask(cached: list[int], keys: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive ``[rows, 1, 1, keys]``: row ``b``'s one query (at slot ``cached[b]``) sees slots ``<= cached[b]``."""
    seen = torch.arange(keys, device=device)[None, :] <= torch.tensor(cached, device=device)[:, None]
    mask = torch.zeros(len(cached), keys, dtype=dtype, device=device)
    return mask.masked_fill_(~seen, torch.finfo(dtype).min)[:, None, None, :]


def packed_sdpa(module, query, key, value, attention_mask, *, wedlm_packing: Packing, scaling=None, **kwargs):
    """HF attention function: ``query`` ``[1, heads, T, dim]`` packed; ``key``/``value`` the cache's
    buffers ``[rows, kv_heads, slots, dim]``. Returns ``[1, T, heads, dim]``."""
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
    """Run ``model``'s attention through :func:`packed_sdpa` inside the block (it must be an SDPA model)."""
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
    """Plain SDPA again inside a :func:`packed_attention` block (a no-op outside one): for an ordinary
    forward of the same model between two packed steps, on the thread that runs them (the server's
    scoring, :mod:`megatron_wedlm.serving.scoring`)."""
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
