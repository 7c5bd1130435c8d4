"""One sequence's decoding state (nano-vllm's ``Sequence``): Python values, no tensors."""

from __future__ import annotations

from .result import MAX_NEW_TOKENS, MAX_POSITIONS, STOP_TOKEN


class RowState:
    """One prompt being decoded; ``window`` in logical order from position ``start``.

    ``cache_length``: tokens with exact keys/values in the cache; ``reused``: of them, from a
    prefix cache; ``autoregressive``: a next-token row (a one-slot window).
    """

    __slots__ = ("index", "prompt", "mask_id", "stop_ids", "budget", "capped_by_positions", "window", "start",
                 "cache_length", "reused",
                 "emitted", "block", "forwards", "slots", "stop_reason", "stop_string", "autoregressive", "plan", "owner")

    def __init__(self, index: int, prompt: list[int], *, window_size: int, budget: int, max_new_tokens: int,
                 mask_id: int, stop_ids: frozenset[int], autoregressive: bool = False):
        self.index, self.prompt, self.mask_id, self.stop_ids = index, prompt, mask_id, stop_ids
        self.autoregressive = autoregressive
        self.budget = budget
        self.capped_by_positions = budget < max_new_tokens
        self.window = [mask_id] * min(window_size, budget)  # capped by the budget (docs/method.md §3.5)
        self.start = self.cache_length = len(prompt)
        self.reused = 0
        self.emitted: list[int] = []
        self.block = len(self.window)
        self.forwards = self.slots = 0
        self.stop_reason: str | None = None
        self.stop_string: str | None = None
        self.plan = self.owner = None

    @property
    def finished(self) -> bool:
        return self.stop_reason is not None

    @property
    def remaining(self) -> int:
        return self.budget - len(self.emitted)

    def reordered(self) -> list[int]:
        """Window indices as a forward feeds them: filled slots, then masks."""
        mask = self.mask_id
        filled = [i for i, t in enumerate(self.window) if t != mask]
        return filled + [i for i, t in enumerate(self.window) if t == mask]

    def leading_run(self) -> int:
        """Length of the leftmost run of filled slots."""
        mask = self.mask_id
        for i, token in enumerate(self.window):
            if token == mask:
                return i
        return len(self.window)

    def fill(self, slots: list[int], tokens: list[int]) -> None:
        for i, token in zip(slots, tokens):
            self.window[i] = token

    def ends_within(self, n: int) -> bool:
        """Whether committing ``n`` slots ends the row (a stop token or the budget)."""
        return n >= self.remaining or any(t in self.stop_ids for t in self.window[:n])

    def committable(self, n: int) -> list[int]:
        """The first ``n`` slots, cut after the first stop token."""
        run = self.window[:n]
        for k, token in enumerate(run):
            if token in self.stop_ids:
                return run[: k + 1]
        return run

    def commit(self, n: int, in_cache: bool = True) -> None:
        """Emit the first ``n`` slots and slide the window; ``in_cache``: the cache keeps them."""
        if n == 0:
            return
        run = self.committable(n)
        if run and run[-1] in self.stop_ids:
            self.stop_reason = STOP_TOKEN
        self.emitted += run
        if self.stop_reason is None and len(self.emitted) >= self.budget:
            self.stop_reason = MAX_POSITIONS if self.capped_by_positions else MAX_NEW_TOKENS
        del self.window[:n]
        self.start += n
        if in_cache:
            self.cache_length = self.start

    def grow_to(self, size: int) -> None:
        """Append masks until the window holds ``size`` slots, within the budget."""
        size = min(size, self.remaining)
        if size > len(self.window):
            self.window += [self.mask_id] * (size - len(self.window))
