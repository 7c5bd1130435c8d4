"""Commit policies: what a forward commits, how the window refills (docs/method.md §3.3, §3.6)."""

from __future__ import annotations

from .settings import AUTOREGRESSIVE, BLOCKWISE, STREAMING, DecodeSettings
from .state import RowState


class StreamingPolicy:
    """Commit the leftmost filled run."""

    def __init__(self, window_size: int, fused_refill: bool):
        self.window_size, self.fused_refill = window_size, fused_refill

    def commit_count(self, row: RowState) -> int:
        return row.leading_run()

    def committed(self, row: RowState) -> None:
        """Called after a forward committed slots of ``row``; block-wise starts its next block here."""

    def refill(self, row: RowState, lead: int) -> None:
        """Step e; ``lead``: the slots the next forward will commit."""
        if self.fused_refill:  # the run the next forward commits makes room for W masks in that forward
            if lead:
                row.grow_to(lead + self.window_size)
        else:  # the committed slots are replaced: the next forward carries W slots again
            row.grow_to(self.window_size)


class BlockwisePolicy(StreamingPolicy):
    """Commit a block only once all of it is filled."""

    def commit_count(self, row: RowState) -> int:
        return row.block if row.leading_run() >= row.block else 0

    def committed(self, row: RowState) -> None:
        row.block = min(self.window_size, row.remaining)


def commit_policy(settings: DecodeSettings) -> StreamingPolicy:
    """The policy of ``settings.method``; AR rows are streaming with a one-slot window."""
    if settings.method == AUTOREGRESSIVE:
        return StreamingPolicy(1, fused_refill=True)
    policies = {STREAMING: StreamingPolicy, BLOCKWISE: BlockwisePolicy}
    if settings.method not in policies:
        raise ValueError(f"{settings.method!r} is not a decoding schedule; choose one of {sorted(policies)}")
    return policies[settings.method](settings.window_size, settings.fused_refill)
