"""Context parallelism (CP) for dual-stream rows: which slots a rank holds, and how it attends.

A WeDLM row is ``[xo ; xt]`` per document, twice the document, so long rows are where the
sequence has to be split across GPUs. Under CP each rank of the context-parallel group holds
``S / CP`` slots of every row of the micro-batch and runs the whole model on them; only
attention needs the rest of the row, and gets it by an all-gather of keys and values
(differentiable: its backward reduce-scatters the key/value gradients to their owners).

**Which slots.** The cost of a query is the number of keys it may attend. Under the WeDLM rule
that is about its *logical* position in both streams (memory: causal; prediction block b:
memory before b plus its own block), so a row's cost is two ramps per document, not the one
ramp of a causal row -- and packing several documents makes the ramps irregular. Megatron's
fixed causal split (chunks ``r`` and ``2CP-1-r``) is built for one ramp. Here the row is cut
into ``chunks_per_rank x CP`` equal chunks, each chunk's cost is counted with the attention
rule itself (:func:`megatron_wedlm.data.attention_rule.allowed_pairs_per_query_tile`, summed
over the micro-batch's rows) and chunks go, largest first, to the least-loaded rank with room
(every rank gets the same number). All CP ranks see the same micro-batch, so they compute the
same split without talking. :func:`pairs_per_rank` states the resulting balance.

**What travels.** Rank r's slots are ``slot_order[r*n:(r+1)*n]`` (ascending within a rank).
Its model inputs are those slots of the batch (:meth:`DualStreamBatch.select_slots`: token,
logical position, labels), and ``attention_mask`` is the packed metadata of the *whole* row
plus the slot order (``[B, 4, S]``, :func:`megatron_wedlm.data.pack_attention_metadata`),
so every layer builds the mask of its local queries against the gathered keys on global slot
indices -- the same rule, derived, not re-written.

**Loss and gradients.** Each rank's loss covers its own slots against the step's global
denominators, so the CP ranks' contributions add up to the step loss; Megatron's schedule
multiplies a 2-tuple loss by the CP size and DDP averages over DP x CP, which cancel (see
:func:`megatron_wedlm.training.megatron_engine.schedule_loss_scale`). Loss reports are summed over DP x CP.
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
    """The naive split: rank r holds slots ``[r*S/CP, (r+1)*S/CP)`` (for comparison)."""
    chunks_per_rank_for(seq_len, cp_size)
    return torch.arange(seq_len)


def balanced_slot_order(metadata: AttentionMetadata, cp_size: int, chunks_per_rank: int | None = None) -> Tensor:
    """Slot order ``[S]`` whose consecutive ``S / CP`` runs are the ranks' slots, balanced by pairs.

    Greedy longest-processing-time assignment of equal chunks under a per-rank chunk quota;
    deterministic (ties go to the lower chunk / rank), so every rank computes the same order.
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
    """Allowed attention pairs whose query each rank holds (int64 ``[CP]``, summed over rows).

    ``slot_order`` must be made of whole chunks of :func:`chunks_per_rank_for`'s split (both
    :func:`balanced_slot_order` and :func:`contiguous_slot_order` are).
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
    """All-gather ``[s, ...]`` over ``group`` along dim 0 (rank order); backward reduce-scatters.

    Megatron's sequence-parallel gather with the group swapped: each rank's key/value gradient
    is the sum of what every rank's queries sent back to it.
    """
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(tensor, tensor_parallel_output_grad=True, group=group)


@dataclass(frozen=True)
class ContextParallelShard:
    """This rank's part of a micro-batch: its slots of every row, and the mask inputs.

    ``batch``: ``[B, S / CP]`` (the loss reads labels and weights from it); ``attention_mask``:
    what the model's ``attention_mask`` gets (packed metadata, ``[B, 4, S]`` under CP).
    """

    batch: DualStreamBatch
    attention_mask: Tensor
    slot_order: Tensor | None = None


def shard_batch(batch: DualStreamBatch, cp_rank: int | None = None, cp_size: int | None = None) -> ContextParallelShard:
    """The part of ``batch`` this rank computes (the whole batch without CP).

    ``cp_rank`` / ``cp_size`` default to Megatron's context-parallel group.
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
