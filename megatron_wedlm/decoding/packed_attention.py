"""Padding-free batched forwards: every layer but attention runs on the rows' real tokens only.

Rows of a batched decode carry windows of different widths (W..2W slots under the engine's
schedule) on top of caches of different lengths. Padding every row to the widest costs the
projections, MLPs and norms of the padding too, and on a CPU those dominate a step (measured on
the quickstart-sized model: 1.5x more token slots than real ones over a 32-prompt decode).

So a batched step feeds the model one *packed* sequence ``[1, T]`` (all rows' real tokens, row
after row, each with its logical position id). The linear layers, norms and RoPE are per token
and see no padding. Only attention needs the row structure: :func:`packed_sdpa`, registered in
HF's attention registry under :data:`NAME`, unpacks the queries to ``[rows, width]``, runs
SDPA against the per-row KV cache with the per-row mask
(:meth:`RowKVCache.attention_mask`), and packs the output again. The cache writes each packed
token's keys/values to its row and slot (:class:`Packing`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from transformers import AttentionInterface

NAME = "wedlm_packed_sdpa"


@dataclass(frozen=True)
class Packing:
    """Where each packed token sits: ``row_of[t]``, cache slot ``slot_of[t]``, and the index maps
    between the packed order ``[T]`` and the padded layout ``[rows * width]``."""

    rows: int
    width: int
    row_of: torch.Tensor
    slot_of: torch.Tensor
    to_padded: torch.Tensor  # [rows * width] -> packed token (padding points at token 0; its output is dropped)
    to_packed: torch.Tensor  # [T] -> padded position

    @classmethod
    def build(cls, lengths: list[int], cache_lengths: list[int], device) -> "Packing":
        """Rows of ``lengths`` real tokens each, written after ``cache_lengths`` cached ones."""
        rows, width = len(lengths), max(lengths)
        row_of, slot_of, to_packed = [], [], []
        to_padded = [0] * (rows * width)
        for r, (n, cached) in enumerate(zip(lengths, cache_lengths)):
            for c in range(n):
                to_padded[r * width + c] = len(to_packed)
                to_packed.append(r * width + c)
            row_of += [r] * n
            slot_of += range(cached, cached + n)

        def tensor(values):
            return torch.tensor(values, dtype=torch.long, device=device)

        return cls(rows, width, tensor(row_of), tensor(slot_of), tensor(to_padded), tensor(to_packed))


def packed_sdpa(module, query, key, value, attention_mask, *, wedlm_packing: Packing, scaling=None, **kwargs):
    """HF attention function: ``query`` ``[1, heads, T, dim]`` packed; ``key``/``value`` ``[rows, kv_heads, keys, dim]``.

    Grouped-query attention is left to SDPA (``enable_gqa``) instead of HF's ``repeat_kv``, which
    would copy every row's whole cache once per layer and step.
    """
    p = wedlm_packing
    heads, dim = query.shape[1], query.shape[-1]
    padded = query[0].transpose(0, 1).index_select(0, p.to_padded)  # [rows * width, heads, dim]
    padded = padded.view(p.rows, p.width, heads, dim).transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(
        padded, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=key.shape[1] != heads
    )  # [rows, heads, width, dim]
    return out.transpose(1, 2).reshape(p.rows * p.width, heads, dim).index_select(0, p.to_packed)[None], None


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
