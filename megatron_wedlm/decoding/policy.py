"""Commit policies: what a forward may commit, and how the window is refilled (the scheduler's part).

The two schedules (docs/method.md §3.2, §3.6) share every step but one question, *how many of the
leftmost window slots does this forward commit*:

* :class:`StreamingPolicy`: the leftmost filled run, whatever its length (WeDLM).
* :class:`BlockwisePolicy`: nothing until the whole block of ``window_size`` slots is filled,
  then the block (the baseline WeDLM beats).

The refill order is the other axis, shared by both (``fused_refill``): the reference engine
refills *before* the forward (the run the next forward commits rides along with W new masks),
the paper's order after it (every forward carries W slots).
"""

from __future__ import annotations

from .settings import AUTOREGRESSIVE, BLOCKWISE, STREAMING, DecodeSettings
from .state import RowState


class StreamingPolicy:
    """Commit the leftmost filled run; refill by the engine's or the paper's order."""

    def __init__(self, window_size: int, fused_refill: bool):
        self.window_size, self.fused_refill = window_size, fused_refill

    def commit_count(self, row: RowState) -> int:
        """Slots the next commit takes from the left of ``row``'s window."""
        return row.leading_run()

    def committed(self, row: RowState) -> None:
        """Called after a forward committed slots of ``row``; block-wise starts the next block here
        (its size: what is left of the window, which is W or the rest of the budget)."""

    def refill(self, row: RowState, lead: int) -> None:
        """Step e (docs/method.md §3.2, §3.3); ``lead`` = the slots the next forward will commit."""
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
    """The policy of ``settings.method``. AR rows (:attr:`RowState.autoregressive`) are streaming
    with a window of one slot refilled before the forward: each forward commits the token sampled
    last and predicts the next."""
    if settings.method == AUTOREGRESSIVE:
        return StreamingPolicy(1, fused_refill=True)
    policies = {STREAMING: StreamingPolicy, BLOCKWISE: BlockwisePolicy}
    if settings.method not in policies:
        raise ValueError(f"{settings.method!r} is not a decoding schedule; choose one of {sorted(policies)}")
    return policies[settings.method](settings.window_size, settings.fused_refill)
