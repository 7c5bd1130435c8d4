"""Dual-stream forward of an unmodified HF causal LM: per-slot cross entropy for the objective.

Nothing in the HF model is patched or copied. The WeDLM attention rule reaches the layers
through transformers' own attention interface, which hands an already-4-D ``attention_mask``
to the attention function untouched (``masking_utils``), and RoPE follows the explicit
``position_ids``:

* ``dense`` (CPU, tests): ``attn_implementation="sdpa"`` with an *additive float* mask
  ``[B, 1, S, S]`` (0 = may attend, dtype minimum = may not). A float mask, not a bool one:
  transformers' eager path adds the mask to the scores, so a bool mask would silently be
  wrong there, while a float mask means the same to SDPA and eager. Padding slots attend
  themselves (the kernel-safe form), so no softmax row is empty.
* ``flex`` (GPU): ``attn_implementation="flex_attention"`` with the project's FlexAttention
  ``BlockMask`` (:func:`megatron_wedlm.data.attention_rule.build_block_mask`), which never
  materialises ``S x S``. Rows are padded to whole tiles first.

Logits are computed only for slots that carry a label (masked prediction slots and memory
slots with a next-token label), in float32, so the ``[B, S, vocab]`` tensor of a large
vocabulary is never built for slots that cannot contribute.

The loss is the run's :class:`megatron_wedlm.training.objective.Objective`, as on the Megatron
path, fed with full-vocabulary per-slot cross entropy instead of the vocab-parallel one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megatron_wedlm.data.dual_stream import DualStreamBatch, pad_dual_stream_batch
from megatron_wedlm.model.losses import wedlm_labels

__all__ = [
    "ATTN_IMPLEMENTATION",
    "DualStreamCausalLM",
    "attention_mask_for",
    "dense_additive_mask",
    "dual_stream_cross_entropy",
    "model_inputs",
    "pad_to_tiles",
    "per_slot_cross_entropy",
]

#: project attention backend -> transformers ``attn_implementation``
ATTN_IMPLEMENTATION = {"dense": "sdpa", "flex": "flex_attention"}


def dense_additive_mask(batch: DualStreamBatch, dtype: torch.dtype) -> Tensor:
    """``[B, 1, S, S]`` additive mask: 0 where the WeDLM rule allows, ``finfo(dtype).min`` elsewhere."""
    allowed = batch.dense_attention_mask(padding_attends_self=True)
    if allowed.dim() == 2:
        allowed = allowed.unsqueeze(0)
    blocked = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=allowed.device)
    return torch.where(allowed, torch.zeros((), dtype=dtype, device=allowed.device), blocked).unsqueeze(1)


def pad_to_tiles(batch: DualStreamBatch, tile_size: int) -> DualStreamBatch:
    """Pad a stacked batch with no-loss padding slots up to a multiple of ``tile_size``."""
    length = -(-batch.seq_len // tile_size) * tile_size
    return pad_dual_stream_batch(batch, length)


def attention_mask_for(batch: DualStreamBatch, backend: str, dtype: torch.dtype, tile_size: int = 128) -> Any:
    """The ``attention_mask`` argument for ``backend`` ('dense' or 'flex'); ``batch`` on the model's device."""
    if backend == "dense":
        return dense_additive_mask(batch, dtype)
    if backend == "flex":
        if batch.seq_len % tile_size:
            raise ValueError(f"rows of {batch.seq_len} slots are not whole {tile_size}-tiles; pad_to_tiles() first")
        return batch.block_mask(tile_size=tile_size, padding_attends_self=True)
    raise ValueError(f"attention backend must be 'dense' or 'flex', got {backend!r}")


def model_inputs(batch: DualStreamBatch, backend: str, dtype: torch.dtype, tile_size: int = 128) -> tuple:
    """``(input_ids, position_ids, attention_mask, labels)`` for :class:`DualStreamCausalLM`."""
    labels = wedlm_labels(batch.is_masked, batch.target_ids, batch.ar_labels)
    return batch.input_ids, batch.position_ids, attention_mask_for(batch, backend, dtype, tile_size), labels


def per_slot_cross_entropy(hidden: Tensor, output_layer: nn.Module, labels: Tensor) -> Tensor:
    """Float32 cross entropy ``[B, S]`` of ``output_layer(hidden)`` against ``labels``; 0 where label < 0.

    Only labelled slots go through the output layer. The layer is called even when there is
    none (an empty batch of rows), so every rank runs the same modules, which ZeRO-3's
    parameter gathering relies on.
    """
    flat_labels = labels.reshape(-1)
    keep = (flat_labels >= 0).nonzero().squeeze(1)
    picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, keep)
    logits = output_layer(picked).float()
    ce = F.cross_entropy(logits, flat_labels.index_select(0, keep), reduction="none")
    full = torch.zeros(flat_labels.shape, dtype=torch.float32, device=ce.device)
    return full.index_copy(0, keep, ce).view(labels.shape)


class DualStreamCausalLM(nn.Module):
    """Wraps a HF ``*ForCausalLM``: ``forward(...) -> per-slot cross entropy [B, S]``.

    The wrapper is what DeepSpeed trains (its parameters are the HF model's, under the
    ``hf_model.`` prefix), so ZeRO hooks see the decoder and the output layer as submodules.
    """

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf_model = hf_model

    def forward(self, input_ids: Tensor, position_ids: Tensor, attention_mask: Any, labels: Tensor) -> Tensor:
        decoder = self.hf_model.get_decoder()
        hidden = decoder(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=False
        ).last_hidden_state
        return per_slot_cross_entropy(hidden, self.hf_model.get_output_embeddings(), labels)


def dual_stream_cross_entropy(model: nn.Module, batch: DualStreamBatch, backend: str, dtype: torch.dtype | None = None,
                              tile_size: int = 128) -> Tensor:
    """Per-slot cross entropy ``[B, S]`` of a stacked batch (on the model's device; for ``flex``
    padded to whole tiles) through ``model``: a :class:`DualStreamCausalLM`, or the DeepSpeed
    engine around one. ``dtype``: of the additive dense mask (default: the model's)."""
    dtype = dtype if dtype is not None else next(model.parameters()).dtype
    return model(*model_inputs(batch, backend, dtype, tile_size))
