"""The state of one sequence under parallel decoding, and the operations Algorithm 1 applies to it.

A :class:`RowState` is to the decoder what ``Sequence`` is to nano-vllm: plain Python values
(token lists and counters), no tensors, so a step's bookkeeping costs a few list operations
per row and never a device round trip. The window is kept in *logical* order; the reordered
view a forward needs (filled slots first, then masks) is derived from it by :meth:`reordered`.
"""

from __future__ import annotations

from .result import MAX_NEW_TOKENS, MAX_POSITIONS, STOP_TOKEN


class RowState:
    """One prompt being decoded.

    * ``window``: the uncommitted slots in logical order, each a token or ``mask_id``.
    * ``start``: logical position of ``window[0]``.
    * ``cache_length``: how many tokens of the row have exact keys/values in the cache (the
      prompt and the committed runs; a run emitted without a forward has none).
    * ``reused``: the prompt's first tokens whose keys/values a prefix cache put in the row's cache
      before its first forward (:mod:`.prefix_cache`); that forward feeds the prompt from there.
    * ``budget``: how many tokens this row may emit (``max_new_tokens`` capped by positions).
    * ``emitted``: the tokens committed and emitted so far.
    * ``block``: size of the block being filled (used by the block-wise policy only).
    * ``forwards`` / ``slots``: the forwards this row took part in and the window slots it fed.
    * ``plan`` / ``owner``: how the row is decoded (:class:`~.batch.RowPlan`) and what its caller
      finds it by (a server's request); set by :func:`~.batch.start_row`.
    * ``autoregressive``: a next-token row (a window of one slot, predicted by the last filled token
      instead of by a mask; :class:`~.model_runner.ModelRunner`), so AR requests share a batch with
      parallel ones.
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
        """Tokens this row may still emit."""
        return self.budget - len(self.emitted)

    def reordered(self) -> list[int]:
        """Window indices in the order a forward feeds them: filled slots first, then masks.

        Step a of docs/method.md §3.2.
        """
        mask = self.mask_id
        filled = [i for i, t in enumerate(self.window) if t != mask]
        return filled + [i for i, t in enumerate(self.window) if t == mask]

    def leading_run(self) -> int:
        """Length of the leftmost run of filled slots (in logical order)."""
        mask = self.mask_id
        for i, token in enumerate(self.window):
            if token == mask:
                return i
        return len(self.window)

    def fill(self, slots: list[int], tokens: list[int]) -> None:
        """Put ``tokens`` into the mask slots ``slots`` (window indices)."""
        for i, token in zip(slots, tokens):
            self.window[i] = token

    def ends_within(self, n: int) -> bool:
        """Whether committing the first ``n`` slots would finish this row (a stop token or the budget)."""
        return n >= self.remaining or any(t in self.stop_ids for t in self.window[:n])

    def committable(self, n: int) -> list[int]:
        """The first ``n`` window slots up to and including the first stop token: what committing them emits."""
        run = self.window[:n]
        for k, token in enumerate(run):
            if token in self.stop_ids:
                return run[: k + 1]
        return run

    def commit(self, n: int, in_cache: bool = True) -> None:
        """Emit the first ``n`` window slots (up to and including a stop token) and slide the window past them.

        ``in_cache``: their keys/values, computed in the forward that fed them first in the
        reordered window, are exact and the cache keeps them; False for a run emitted without a
        forward (the row is over, see :mod:`.parallel`).
        """
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
        """Append mask slots (next logical positions) until the window holds ``size`` slots, within the budget."""
        size = min(size, self.remaining)
        if size > len(self.window):
            self.window += [self.mask_id] * (size - len(self.window))
