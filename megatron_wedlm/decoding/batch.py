"""The continuous batch: rows wait, take free places, go through one forward per step, and leave.

:class:`RowBatch` is the one decoding loop (nano-vllm's scheduler and step) of :func:`.decode` and
the server's engine; each row's :class:`RowPlan` lets one batch mix methods and settings.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable
from itertools import accumulate
from typing import Any

import torch

from .checks import check_fits, check_full_attention, generation_budget, resolve_mask_token_id
from .model_runner import ModelRunner
from .policy import commit_policy
from .result import STOP_STRING, GenerationResult, decode_text, find_stop_string
from .sampling import SlotSampler, stop_token_vocabulary
from .settings import AUTOREGRESSIVE, DecodeSettings
from .state import RowState

#: the stop reason of a row its caller dropped (a server's client went away)
CANCELLED = "cancelled"
#: the mask id of AR rows of a model without a mask token: never fed, never a logit (:class:`ModelRunner`)
NO_MASK = -1


class RowPlan:
    """How one row is decoded: settings, commit policy and sampler (shared by rows of one plan)."""

    __slots__ = ("settings", "policy", "sampler")

    def __init__(self, settings: DecodeSettings, tokenizer=None, generator: torch.Generator | None = None):
        if settings.method == AUTOREGRESSIVE:  # one slot per forward: the parallel-only settings do not apply
            settings = dataclasses.replace(settings, window_size=1, entropy_threshold=None, stop_penalty=False,
                                           contiguous_stop=False, fused_refill=True, leftmost_fallback=False)
        self.settings = settings
        self.policy = commit_policy(settings)
        stop_vocabulary = (stop_token_vocabulary(tokenizer, settings.stop_token_ids, settings.stop_strings)
                           if settings.stop_penalty else ())
        self.sampler = SlotSampler(settings, generator, stop_vocabulary)


def check_settings(model, settings: DecodeSettings) -> int:
    """The model's mask token (:data:`NO_MASK` for AR without one), after checking ``settings``."""
    check_full_attention(model)
    if settings.method == AUTOREGRESSIVE and settings.mask_token_id is None \
            and getattr(model.config, "mask_token_id", None) is None:
        return NO_MASK
    mask_id = resolve_mask_token_id(model, settings.mask_token_id)
    DecodeSettings.build(settings, mask_token_id=mask_id)  # its checks, with the model's mask token: not a stop token
    return mask_id


def start_row(model, index: int, prompt: list[int], plan: RowPlan, mask_id: int, owner: Any = None) -> RowState:
    """``prompt``'s state before its first forward; ``owner``: what the caller finds it by."""
    settings = plan.settings
    check_fits(model, len(prompt), min(settings.window_size, settings.max_new_tokens))
    row = RowState(
        index, prompt, window_size=settings.window_size,
        budget=generation_budget(model, len(prompt), settings.max_new_tokens),
        max_new_tokens=settings.max_new_tokens, mask_id=mask_id, stop_ids=frozenset(settings.stop_token_ids),
        autoregressive=settings.method == AUTOREGRESSIVE,
    )
    row.plan, row.owner = plan, owner
    return row


def row_result(row: RowState, seconds: float, tokenizer) -> GenerationResult:
    return GenerationResult(
        token_ids=row.emitted,
        num_forwards=row.forwards,
        num_slots=row.slots,
        seconds=seconds,
        method=row.plan.settings.method,
        stop_reason=row.stop_reason,
        text=decode_text(tokenizer, row.emitted, row.stop_string) if tokenizer is not None else None,
        stop_string=row.stop_string,
    )


class RowBatch:
    """Rows waiting (FIFO) and up to ``max_rows`` live rows in ``runner``'s cache.

    A row's result does not depend on which rows it shares forwards with; ``lock`` guards
    :meth:`add` and :meth:`cancel` from other threads.
    """

    def __init__(self, runner: ModelRunner, max_rows: int, tokenizer=None, lock=None):
        if max_rows < 1:
            raise ValueError(f"max_rows must be at least 1, got {max_rows}")
        self.runner, self.max_rows, self.tokenizer = runner, max_rows, tokenizer
        self.lock = lock if lock is not None else contextlib.nullcontext()
        self.waiting: dict[int, RowState] = {}  # index -> row, in arrival order; a dict: cancelling is O(1)
        self.live: list[RowState] = []  # in cache-row order
        self._joining: list[RowState] = []  # admitted by the step under way, not live until it advances
        self._cancelled: set[int] = set()  # live rows to drop at the next step

    def add(self, row: RowState) -> None:
        """Queue ``row`` (its ``index`` unique in the batch)."""
        self.waiting[row.index] = row

    def cancel(self, index: int) -> bool:
        """Drop row ``index``: True if it was still waiting; a live one leaves at the next step."""
        if self.waiting.pop(index, None) is not None:
            return True
        self._cancelled.add(index)
        return False

    def running(self) -> int:
        return sum(not row.finished for row in self.live)

    def clear(self) -> list[RowState]:
        """Drop every row (the engine failed); returns the rows not ended."""
        rows = list(self.waiting.values()) + self._joining + [row for row in self.live if not row.finished]
        self.waiting, self._joining, self.live = {}, [], []
        return rows

    def __bool__(self) -> bool:
        """Rows wait, or live ones are left to step or to release."""
        return bool(self.waiting or self.live)

    def step(self) -> list[RowState]:
        """Admit, release, one forward; the rows that ended (cancelled: :data:`CANCELLED`)."""
        with self.lock:
            cancelled, self._cancelled = self._cancelled, set()
            ended = [row for row in self.live if not row.finished and row.index in cancelled]
            for row in ended:
                row.stop_reason = CANCELLED
            free = self.max_rows - self.running()
            self._joining = [self.waiting.pop(i) for i in list(self.waiting)[: max(0, free)]]
        self.live = self.runner.advance(self.live, self._joining)  # ended rows leave; joining ones take their places
        self._joining = []
        if not self.live:
            return ended
        decode_step(self.runner, self.live, self.tokenizer)
        return ended + [row for row in self.live if row.finished]


def decode_step(runner: ModelRunner, live: Iterable[RowState], tokenizer) -> None:
    """One forward of docs/method.md §3.2 (a-e) over the ``live`` rows, each by its own plan."""
    live = list(live)
    plans = [row.plan for row in live]
    commits = [plan.policy.commit_count(row) for plan, row in zip(plans, live)]  # c. decided by what this forward feeds
    logits, mask_slots, fed = runner.forward(live)  # a, b. reordered windows, one causal forward
    fills = _choose(logits, mask_slots, plans)  # d. entropy rule on the masks of this forward
    for row, plan, n, (slots, tokens), count in zip(live, plans, commits, fills, fed):
        row.forwards += 1
        row.slots += count
        row.fill(slots, tokens)
        _commit(row, n, tokenizer, plan.settings)  # c. the leftmost filled run: its KV is exact
        if n:
            plan.policy.committed(row)
        if row.finished:
            continue
        lead = plan.policy.commit_count(row)
        if row.ends_within(lead) or _completes_stop_string(row, lead, tokenizer, plan.settings):
            _commit(row, lead, tokenizer, plan.settings, in_cache=False)  # over: its last run needs no KV, no forward
        else:
            plan.policy.refill(row, lead)  # e.


def _choose(logits: torch.Tensor, mask_slots: list[list[int]], plans: list[RowPlan]) -> list[tuple[list[int], list[int]]]:
    samplers = {id(plan.sampler): plan.sampler for plan in plans}
    if len(samplers) == 1:
        return plans[0].sampler.choose(logits, mask_slots)
    offsets = list(accumulate((len(slots) for slots in mask_slots), initial=0))
    fills: list = [None] * len(plans)
    for key, sampler in samplers.items():
        members = [r for r, plan in enumerate(plans) if id(plan.sampler) == key]
        index = [k for r in members for k in range(offsets[r], offsets[r + 1])]
        part = logits.index_select(0, torch.tensor(index, dtype=torch.long, device=logits.device))
        for r, fill in zip(members, sampler.choose(part, [mask_slots[r] for r in members])):
            fills[r] = fill
    return fills


def _completes_stop_string(row: RowState, n: int, tokenizer, settings: DecodeSettings) -> bool:
    if not n or not settings.stop_strings:
        return False
    tokens = row.emitted + row.committable(n)
    return find_stop_string(tokenizer, tokens, settings.stop_strings, len(row.emitted)) is not None


def _commit(row: RowState, n: int, tokenizer, settings: DecodeSettings, in_cache: bool = True) -> None:
    """``row.commit(n)``, then end the row at a stop string that committing completes."""
    checked = len(row.emitted)  # held no stop string, or the row would have ended
    row.commit(n, in_cache)
    if n and settings.stop_strings:
        hit = find_stop_string(tokenizer, row.emitted, settings.stop_strings, checked)
        if hit is not None:
            del row.emitted[hit[0] :]
            row.stop_reason, row.stop_string = STOP_STRING, hit[1]
