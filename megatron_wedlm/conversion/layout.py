"""How Megatron-Core lays out the tensors HF keeps separate, in the full (TP=1) layout.

``linear_qkv`` fuses q/k/v per query group (its query heads, then its key and value head), so
TP chunks hold whole groups; ``linear_fc1`` stacks [gate; up], each TP rank [gate_r; up_r];
the vocabulary is padded with rows. Weights ``[rows, in]`` and biases ``[rows]`` alike.
"""

from __future__ import annotations

import torch


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_query_groups: int) -> torch.Tensor:
    """HF q/k/v projections -> Megatron's grouped ``linear_qkv`` rows."""
    tail = q.shape[1:]
    groups = [t.reshape(num_query_groups, -1, *tail) for t in (q, k, v)]
    return torch.cat(groups, dim=1).reshape(-1, *tail)


def split_qkv(
    qkv: torch.Tensor, num_attention_heads: int, num_query_groups: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`."""
    tail = qkv.shape[1:]
    per_group = num_attention_heads // num_query_groups
    grouped = qkv.reshape(num_query_groups, (per_group + 2) * head_dim, *tail)
    q, k, v = torch.split(grouped, [per_group * head_dim, head_dim, head_dim], dim=1)
    return (
        q.reshape(-1, *tail).contiguous(),
        k.reshape(-1, *tail).contiguous(),
        v.reshape(-1, *tail).contiguous(),
    )


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.cat([gate, up], dim=0)


def split_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = torch.chunk(fc1, 2, dim=0)
    return gate.contiguous(), up.contiguous()


def resize_rows(tensor: torch.Tensor, rows: int, fill: torch.Tensor | None = None) -> torch.Tensor:
    """Keep the first ``rows`` rows, or append rows (``fill`` broadcast, zeros by default)."""
    current = tensor.shape[0]
    if rows <= current:
        return tensor[:rows]
    extra = torch.zeros(rows - current, *tensor.shape[1:], dtype=tensor.dtype)
    if fill is not None:
        extra[:] = fill.to(tensor.dtype)
    return torch.cat([tensor, extra], dim=0)


def tp_local_shard(
    full: torch.Tensor, partition_dim: int | None, tp_rank: int, tp_size: int, gated: bool = False
) -> torch.Tensor:
    """This TP rank's piece of a full Megatron tensor; ``partition_dim`` None: replicated,
    ``gated``: ``linear_fc1`` of a gated MLP (the rank's gate rows, then its up rows).
    """
    if partition_dim is None or tp_size == 1:
        return full
    if gated:
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(gate, tp_size, dim=0)[tp_rank], torch.chunk(up, tp_size, dim=0)[tp_rank]])
    if full.shape[partition_dim] % tp_size != 0:
        raise ValueError(
            f"dimension {partition_dim} of size {full.shape[partition_dim]} does not split over TP={tp_size}"
        )
    return torch.chunk(full, tp_size, dim=partition_dim)[tp_rank]
