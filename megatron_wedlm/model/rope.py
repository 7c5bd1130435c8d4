"""Rotary position embedding driven by each slot's *logical* position id.

Why not Megatron's default: ``GPTModel`` builds RoPE for positions ``0 .. S-1`` of the physical
row (``RotaryEmbedding.forward(max_seq_len)`` -> ``[S, 1, 1, D]``), ignoring ``position_ids``.
A dual-stream row ``[xo ; xt]`` has length 2L, and the prediction stream is topologically
reordered: slot ``j`` carries logical position ``position_ids[b, j]``, which is neither ``j`` nor
the same across rows. WeDLM's whole trick depends on RoPE seeing the logical positions.

Megatron's attention applies ``rotary_pos_emb`` with ``t * cos(f) + rotate_half(t) * sin(f)``
where ``f`` broadcasts against ``t = [S, B, heads, D]`` (rope_utils._apply_rotary_pos_emb_bshd).
So instead of the ``[S, 1, 1, D]`` table we hand it per-slot frequencies ``[S, B, 1, D]``; the
unfused path broadcasts them over heads and everything else (QK-norm before RoPE, GQA, TP
head splits) is untouched. The fused TE kernel only accepts one position table for the whole
batch, so the model requires ``apply_rope_fusion=False``.

The inverse frequencies come from Megatron's own ``RotaryEmbedding`` (base, rotary_percent,
Llama-3 rope scaling, interpolation factor), so a WeDLM model and the AR model it was converted
from agree on every frequency.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["LogicalRotaryEmbedding"]


class LogicalRotaryEmbedding(torch.nn.Module):
    """``position_ids [B, S]`` -> rotary frequencies ``[S, B, 1, D]`` for Megatron attention.

    Holds no parameters (nothing enters the checkpoint).
    """

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
