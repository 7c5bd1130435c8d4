"""Decisions taken once, on rank 0, and shared with every rank."""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch.distributed as dist

__all__ = ["agreed"]

T = TypeVar("T")


def agreed(compute: Callable[[], T]) -> T:
    """``compute()`` on rank 0, the same answer everywhere (nodes may list a shared directory
    differently for a moment, e.g. NFS attribute caching). When rank 0 raises, every rank
    raises that error (the others would otherwise wait in the broadcast until the timeout)."""
    outcome: list[Any] = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            outcome = [(True, compute())]
        except Exception as err:  # noqa: BLE001 - re-raised below, on every rank
            outcome = [(False, err)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(outcome, src=0)
    ok, value = outcome[0]
    if not ok:
        raise value
    return value
