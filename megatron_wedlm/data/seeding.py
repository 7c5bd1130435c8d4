"""Per-rank, per-step random streams for mask sampling.

Data-parallel ranks must draw different masks (else the replicas train on one corruption), and a
restarted job must redraw the same masks for the same step: a hash of (seed, rank, step) gives
stateless seeds, with no generator state to checkpoint.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["rank_seed", "rank_generator"]


def rank_seed(seed: int, dp_rank: int, step: int) -> int:
    """A 63-bit seed derived from (seed, data-parallel rank, step) by a cryptographic hash."""
    for name, value in (("seed", seed), ("dp_rank", dp_rank), ("step", step)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    digest = hashlib.blake2b(f"wedlm-mask:{seed}:{dp_rank}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def rank_generator(seed: int, dp_rank: int, step: int) -> torch.Generator:
    """A CPU ``torch.Generator`` for building the masks of ``dp_rank`` at ``step``."""
    return torch.Generator().manual_seed(rank_seed(seed, dp_rank, step))
