"""Rotary position embedding driven by each slot's *logical* position id.

Megatron's ``GPTModel`` builds RoPE for physical positions ``0 .. S-1``; WeDLM's reordered rows
need ``position_ids``. So attention gets per-slot frequencies ``[S, B, 1, D]`` instead of the
``[S, 1, 1, D]`` table (the fused kernel takes one table per batch: ``apply_rope_fusion=False``).
Inverse frequencies are Megatron's ``RotaryEmbedding``'s, so they match the AR source model.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["LogicalRotaryEmbedding"]


class LogicalRotaryEmbedding(torch.nn.Module):
    """``position_ids [B, S]`` -> rotary frequencies ``[S, B, 1, D]``; no parameters."""

    def __init__(
        self,
        kv_channels: int,
        rotary_percent: float = 1.0,
        rotary_base: float = 10000.0,
        rotary_interleaved: bool = False,
        seq_len_interpolation_factor: float | None = None,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
    ) -> None:
        super().__init__()
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        table = RotaryEmbedding(
            kv_channels=kv_channels,
            rotary_percent=rotary_percent,
            rotary_interleaved=rotary_interleaved,
            seq_len_interpolation_factor=seq_len_interpolation_factor,
            rotary_base=rotary_base,
            rope_scaling=rope_scaling,
            rope_scaling_factor=rope_scaling_factor,
            use_cpu_initialization=True,
            cp_group=None,
        )
        self.register_buffer("inv_freq", table.inv_freq.detach().clone().float(), persistent=False)
        self.rotary_interleaved = rotary_interleaved
        self.seq_len_interpolation_factor = seq_len_interpolation_factor

    def forward(self, position_ids: Tensor) -> Tensor:
        if position_ids is None:
            raise ValueError(
                "position_ids is None: a WeDLM model needs the logical position ids on every "
                "pipeline stage (pass the batch's position_ids to the model on all stages)"
            )
        if position_ids.dim() != 2:
            raise ValueError(f"position_ids must be [batch, seq], got shape {tuple(position_ids.shape)}")
        inv_freq = self.inv_freq.to(position_ids.device)
        positions = position_ids.transpose(0, 1).to(inv_freq.dtype)  # [S, B]
        if self.seq_len_interpolation_factor is not None:
            positions = positions * (1 / self.seq_len_interpolation_factor)  # as Megatron does
        freqs = positions.unsqueeze(-1) * inv_freq  # [S, B, D/2]
        if self.rotary_interleaved:
            emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb.unsqueeze(2)  # [S, B, 1, D]
