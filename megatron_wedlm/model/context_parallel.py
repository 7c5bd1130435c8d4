"""Context parallelism (CP) for dual-stream rows: which slots a rank holds, and how it attends.

Each rank holds ``S / CP`` slots of every row: equal chunks assigned by their allowed attention
pairs, largest first to the least-loaded rank, the same on every rank without communication
(docs/training.md §9). Rank r's slots are ``slot_order[r*n:(r+1)*n]``; its ``attention_mask``
is the whole row's packed metadata plus the slot order (``[B, 4, S]``), and attention
all-gathers keys/values. Losses use the step's global denominators, so the ranks' parts add up
(Megatron's CP loss scaling: :func:`megatron_wedlm.training.megatron_engine.schedule_loss_scale`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_wedlm.data.attention_rule import AttentionMetadata, allowed_pairs_per_query_tile
from megatron_wedlm.data.dual_stream import DualStreamBatch
from megatron_wedlm.data.packed_metadata import pack_attention_metadata

__all__ = [
    "ContextParallelShard",
    "balanced_slot_order",
    "chunks_per_rank_for",
    "context_parallel_group",
    "contiguous_slot_order",
    "gather_along_sequence",
    "pairs_per_rank",
    "shard_batch",
]

MAX_CHUNKS_PER_RANK = 8


def chunks_per_rank_for(seq_len: int, cp_size: int) -> int:
    """The finest split (at most 8 chunks per rank) whose chunks tile the row exactly."""
    if seq_len % (2 * cp_size):
        raise ValueError(
            f"a row of {seq_len} slots cannot be split over context_parallel_size={cp_size}: the "
            f"row length must be a multiple of 2 x CP = {2 * cp_size} (set data.seq_length accordingly)"
        )
    per_rank = MAX_CHUNKS_PER_RANK
    while seq_len % (per_rank * cp_size):
        per_rank //= 2
    return per_rank


def contiguous_slot_order(seq_len: int, cp_size: int) -> Tensor:
    """The naive split: rank r holds slots ``[r*S/CP, (r+1)*S/CP)``."""
    chunks_per_rank_for(seq_len, cp_size)
    return torch.arange(seq_len)


def balanced_slot_order(metadata: AttentionMetadata, cp_size: int, chunks_per_rank: int | None = None) -> Tensor:
    """Slot order ``[S]`` whose consecutive ``S / CP`` runs are the ranks' slots, balanced by pairs;
    deterministic, so every rank computes the same order.
    """
    meta = metadata.batched()
    seq_len = meta.seq_len
    per_rank = chunks_per_rank if chunks_per_rank is not None else chunks_per_rank_for(seq_len, cp_size)
    num_chunks = per_rank * cp_size
    if seq_len % num_chunks:
        raise ValueError(f"{num_chunks} chunks do not tile a row of {seq_len} slots")
    chunk = seq_len // num_chunks
    cost = allowed_pairs_per_query_tile(meta, chunk).sum(0).tolist()
    load = [0] * cp_size
    owned: list[list[int]] = [[] for _ in range(cp_size)]
    for c in sorted(range(num_chunks), key=lambda c: (-cost[c], c)):
        rank = min((r for r in range(cp_size) if len(owned[r]) < per_rank), key=lambda r: (load[r], r))
        owned[rank].append(c)
        load[rank] += cost[c]
    starts = [c * chunk for rank_chunks in owned for c in sorted(rank_chunks)]
    return torch.cat([torch.arange(s, s + chunk) for s in starts]).to(meta.doc_ids.device)


def pairs_per_rank(metadata: AttentionMetadata, slot_order: Tensor, cp_size: int) -> Tensor:
    """Allowed attention pairs whose query each rank holds (int64 ``[CP]``, summed over rows);
    ``slot_order`` must consist of whole chunks of :func:`chunks_per_rank_for`'s split.
    """
    meta = metadata.batched()
    chunk = meta.seq_len // (cp_size * chunks_per_rank_for(meta.seq_len, cp_size))
    cost = allowed_pairs_per_query_tile(meta, chunk).sum(0)
    chunk_ids = slot_order[::chunk].to(cost.device) // chunk
    return cost.index_select(0, chunk_ids).reshape(cp_size, -1).sum(-1)


def context_parallel_group():
    """Megatron's context-parallel group, or None when parallel state is not set up."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None
    return ps.get_context_parallel_group()


def gather_along_sequence(tensor: Tensor, group) -> Tensor:
    """All-gather ``[s, ...]`` over ``group`` along dim 0 (rank order); backward reduce-scatters."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(tensor, tensor_parallel_output_grad=True, group=group)


@dataclass(frozen=True)
class ContextParallelShard:
    """This rank's part of a micro-batch: ``batch`` ``[B, S / CP]`` and its ``attention_mask``."""

    batch: DualStreamBatch
    attention_mask: Tensor
    slot_order: Tensor | None = None


def shard_batch(batch: DualStreamBatch, cp_rank: int | None = None, cp_size: int | None = None) -> ContextParallelShard:
    """The part of ``batch`` this rank computes (all of it without CP); ``cp_rank``/``cp_size``
    default to Megatron's context-parallel group.
    """
    if cp_size is None:
        group = context_parallel_group()
        cp_size = 1 if group is None else group.size()
        cp_rank = 0 if group is None else group.rank()
    metadata = batch.attention_metadata()
    if cp_size == 1:
        return ContextParallelShard(batch, pack_attention_metadata(metadata))
    if cp_rank is None or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is not a rank of a context-parallel group of {cp_size}")
    order = balanced_slot_order(metadata, cp_size)
    n = batch.seq_len // cp_size
    local = batch.select_slots(order[cp_rank * n:(cp_rank + 1) * n])
    return ContextParallelShard(local, pack_attention_metadata(metadata, slot_order=order), order)
