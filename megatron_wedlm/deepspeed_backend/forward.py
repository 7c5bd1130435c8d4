"""Dual-stream forward of an unmodified HF causal LM: per-slot cross entropy for the objective.

The WeDLM rule reaches the layers through transformers' attention interface, which passes a 4-D
``attention_mask`` through untouched; RoPE follows ``position_ids``. ``sdpa`` (dense; CPU) takes an
additive float mask (a bool one would be wrong on the eager path), padding slots attending
themselves; ``flex_attention`` (GPU) takes the project's ``BlockMask`` on tile-padded rows. Logits
are computed in float32 for labelled slots only.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megatron_wedlm.data.dual_stream import DualStreamBatch, pad_dual_stream_batch
from megatron_wedlm.model.attention_backends import AttentionBackend, backend_names, get_attention_backend
from megatron_wedlm.model.losses import wedlm_labels

__all__ = [
    "DualStreamCausalLM",
    "attention_mask_for",
    "dense_additive_mask",
    "dual_stream_cross_entropy",
    "hf_attention_backend",
    "model_inputs",
    "pad_rows",
    "per_slot_cross_entropy",
]


def hf_attention_backend(name: str) -> AttentionBackend:
    """The table's row for a resolved backend name that HF models can run (ValueError otherwise)."""
    backend = get_attention_backend(name)
    if backend.hf_attn_implementation is None:
        usable = backend_names(lambda b: b.hf_attn_implementation is not None)
        raise ValueError(f"attention backend {name!r} has no HF attention implementation; use {', '.join(usable)}")
    return backend


def dense_additive_mask(batch: DualStreamBatch, dtype: torch.dtype) -> Tensor:
    """``[B, 1, S, S]`` additive mask: 0 where the WeDLM rule allows, ``finfo(dtype).min`` elsewhere."""
    allowed = batch.dense_attention_mask(padding_attends_self=True)
    if allowed.dim() == 2:
        allowed = allowed.unsqueeze(0)
    blocked = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=allowed.device)
    return torch.where(allowed, torch.zeros((), dtype=dtype, device=allowed.device), blocked).unsqueeze(1)


def pad_rows(batch: DualStreamBatch, backend: str) -> DualStreamBatch:
    """Pad a stacked batch with no-loss padding slots to what ``backend``'s rows must be a multiple of."""
    multiple = hf_attention_backend(backend).pad_rows_to
    return pad_dual_stream_batch(batch, -(-batch.seq_len // multiple) * multiple)


def attention_mask_for(batch: DualStreamBatch, backend: str, dtype: torch.dtype) -> Any:
    """The ``attention_mask`` argument for ``backend`` (a resolved name); ``batch`` on the model's device."""
    row = hf_attention_backend(backend)
    if row.hf_attn_implementation != "flex_attention":  # sdpa (and eager) take the additive mask
        return dense_additive_mask(batch, dtype)
    if batch.seq_len % row.pad_rows_to:
        raise ValueError(f"rows of {batch.seq_len} slots are not whole {row.pad_rows_to}-tiles; pad_rows() first")
    return batch.block_mask(tile_size=row.pad_rows_to, padding_attends_self=True)


def model_inputs(batch: DualStreamBatch, backend: str, dtype: torch.dtype) -> tuple:
    """``(input_ids, position_ids, attention_mask, labels)`` for :class:`DualStreamCausalLM`."""
    labels = wedlm_labels(batch.is_masked, batch.target_ids, batch.ar_labels)
    return batch.input_ids, batch.position_ids, attention_mask_for(batch, backend, dtype), labels


def per_slot_cross_entropy(hidden: Tensor, output_layer: nn.Module, labels: Tensor) -> Tensor:
    """Float32 cross entropy ``[B, S]`` of ``output_layer(hidden)`` against ``labels`` (0 where label < 0),
    for labelled slots only; the layer runs even with none, as ZeRO-3's gathering needs every rank to."""
    flat_labels = labels.reshape(-1)
    keep = (flat_labels >= 0).nonzero().squeeze(1)
    picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, keep)
    logits = output_layer(picked).float()
    ce = F.cross_entropy(logits, flat_labels.index_select(0, keep), reduction="none")
    full = torch.zeros(flat_labels.shape, dtype=torch.float32, device=ce.device)
    return full.index_copy(0, keep, ce).view(labels.shape)


class DualStreamCausalLM(nn.Module):
    """Wraps a HF ``*ForCausalLM``: ``forward(...) -> per-slot cross entropy [B, S]``; what DeepSpeed
    trains, so ZeRO hooks see the decoder and the output layer as submodules."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf_model = hf_model

    def forward(self, input_ids: Tensor, position_ids: Tensor, attention_mask: Any, labels: Tensor) -> Tensor:
        decoder = self.hf_model.get_decoder()
        hidden = decoder(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=False
        ).last_hidden_state
        return per_slot_cross_entropy(hidden, self.hf_model.get_output_embeddings(), labels)


def dual_stream_cross_entropy(model: nn.Module, batch: DualStreamBatch, backend: str,
                              dtype: torch.dtype | None = None) -> Tensor:
    """Per-slot cross entropy ``[B, S]`` of a stacked, padded batch through ``model`` (a
    :class:`DualStreamCausalLM` or the DeepSpeed engine around one); ``dtype``: of the dense mask."""
    dtype = dtype if dtype is not None else next(model.parameters()).dtype
    return model(*model_inputs(batch, backend, dtype))
