"""Streaming parallel decoding (WeDLM Algorithm 1) and the block-wise baseline, for a batch of prompts.

The engine is split as nano-vllm's: per-row state (:class:`~.state.RowState`), a commit policy
per schedule (:mod:`.policy`: streaming commits the leftmost filled run, block-wise a whole
filled block), the tensors and the forward (:class:`~.model_runner.ModelRunner`), the fill rule
and sampler (:class:`~.sampling.SlotSampler`); :func:`decode` is the loop that ties them together
and reads like Algorithm 1.

Refill order (``fused_refill``):

* ``True`` (default; the schedule of the reference engine, Tencent/WeDLM ``wedlm/engine``, which
  its published speeds come from): the window is refilled *before* the forward. The leftmost
  filled run of n slots that the next forward commits rides in that forward together with the n
  new masks appended after the window, so a forward carries W + n <= 2W slots and no forward is
  spent on committing alone (tau = infinity, W = 4: 10 forwards instead of 19).
* ``False`` (Algorithm 1 in the paper's step order, docs/method.md §3.3): after a forward commits its
  leftmost filled run of n slots, n new masks are appended, so every forward carries exactly
  ``window_size`` slots (the paper's fixed parallel workload). The new masks get their first
  prediction in the next forward. ``tools/bench_decode.py`` measures both.

Engine rules followed (docs/method.md §3.4): a slot's confidence is the entropy of its raw logits at
temperature 1; a slot qualifies when ``H + lambda * d < tau`` (strict), d = its window index
minus that of the first remaining mask; if none qualifies (or tau is None) exactly the argmin
is filled (first on ties); greedy = argmax; a stop token is emitted and ends the row.
``num_forwards`` counts the forwards of a row until it finishes, the prompt's prefill being
fused into the first one, which is the engine's ``decode_forwards``. Deliberate deviations from
the engine: the window is capped by the remaining token budget (the engine decodes past it and
truncates), and the mask token is never emitted (its logit is excluded before entropy and
sampling); two optional ones are off by default: ``contiguous_stop``, a stop token only
after filled slots (:func:`~.sampling.hold_early_stops`), and ``stop_penalty``, a slot after
masks that may hold a stop token scored by the chance that the reply goes on
(:func:`~.sampling.select_slots`). A row stops at ``stop_token_ids``; by default (None) those
are the model's EOS ids, as HF ``generate`` and the engine stop, and ``()`` decodes without any.

Choices this module makes (the method leaves them open; docs/method.md §3.5):

* A generation that is over needs no keys/values for its last tokens: when, after the predict
  step, the leftmost filled run already reaches a stop token or the token budget, it is emitted
  without one more forward (AR decoding does not forward its last sampled token either).
  The output is the same as committing it in a further forward.
* Rows of a batch are independent: each has its own window, cache length and budget; finished
  rows leave the batch, and with ``batch_rows`` the next prompts join it in their places. Greedy
  results equal one-at-a-time decoding (tests/test_decoding.py checks it for several batch sizes
  and orders on CPU in fp32; in bf16 on a GPU, kernels chosen by batch shape can round
  differently, which can flip a near-tie).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable
from itertools import accumulate

import torch

from .checks import (
    check_fits,
    check_full_attention,
    generation_budget,
    resolve_mask_token_id,
    with_default_stops,
)
from .model_runner import ModelRunner
from .policy import commit_policy
from .result import STOP_STRING, GenerationResult, decode_text, find_stop_string
from .sampling import SlotSampler, stop_token_vocabulary
from .settings import AUTOREGRESSIVE, PARALLEL_METHODS, DecodeSettings
from .state import RowState


class RowPlan:
    """How one row is decoded: its settings, commit policy and sampler. Rows of one batch may have
    different plans (a server's requests do); rows that share a plan share its sampler's tensor ops.
    """

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


@torch.inference_mode()
def decode(
    model,
    prompts: list[list[int]],
    settings: DecodeSettings,
    *,
    tokenizer=None,
    generator: torch.Generator | None = None,
    batch_rows: int | None = None,
    on_result: Callable[[int, GenerationResult], None] | None = None,
) -> tuple[list[GenerationResult], ModelRunner]:
    """Decode ``prompts`` together with ``settings.method`` (``"streaming"`` or ``"blockwise"``).

    ``batch_rows`` (default: all prompts) caps how many rows are decoded at once: the first
    ``batch_rows`` prompts start, and whenever rows finish, the next prompts take their places (their
    prompts are prefilled in their first forward, beside the other rows' windows), so the batch stays
    full until the prompts run out (continuous batching). A row's result does not depend on which
    rows it shared forwards with. ``on_result(index, result)`` is called as each prompt finishes
    (its ``seconds``: since the call began), so a caller can keep results before the batch ends.

    Returns one result per prompt, in order, and the model runner: its KV cache (rows: those still
    live in the last step) is what tests compare against a plain causal forward, its ``steps``
    what benchmarks replay.
    """
    start = time.perf_counter()
    if not settings.is_parallel:
        raise ValueError(f"{settings.method!r} is not a parallel decoding schedule; choose one of {PARALLEL_METHODS}")
    settings = with_default_stops(settings, model, tokenizer)
    mask_id = check_settings(model, settings)
    rows = [start_row(model, index, prompt, settings, mask_id) for index, prompt in enumerate(prompts)]
    plan = RowPlan(settings, tokenizer, generator)
    size = len(rows) if batch_rows is None else batch_rows
    if size < 1:
        raise ValueError(f"batch_rows must be at least 1, got {batch_rows}")
    live, waiting = rows[:size], deque(rows[size:])
    with ModelRunner.for_rows(model, rows, settings.window_size, batch_rows=size) as runner:
        while live:
            decode_step(runner, live, lambda row: plan, tokenizer)
            if on_result is not None:
                for row in live:
                    if row.finished:
                        on_result(row.index, row_result(row, time.perf_counter() - start, settings, tokenizer))
            free = size - sum(not row.finished for row in live)  # finished rows' places go to the next prompts
            live = runner.advance(live, [waiting.popleft() for _ in range(min(free, len(waiting)))])

    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    seconds = time.perf_counter() - start
    return [row_result(row, seconds, settings, tokenizer) for row in rows], runner


def decode_step(runner: ModelRunner, live: list[RowState], plan_of: Callable[[RowState], RowPlan], tokenizer) -> None:
    """One forward of Algorithm 1 over the ``live`` rows (none finished), each row by its own plan."""
    plans = [plan_of(row) for row in live]
    commits = [plan.policy.commit_count(row) for plan, row in zip(plans, live)]  # c. decided by what this forward feeds
    logits, mask_slots = runner.forward(live)  # a, b. reordered windows, one causal forward
    fills = _choose(logits, mask_slots, plans)  # d. entropy rule on the masks of this forward
    for row, plan, n, (slots, tokens) in zip(live, plans, commits, fills):
        row.fill(slots, tokens)
        _commit(row, n, tokenizer, plan.settings)  # c. the leftmost filled run: its KV is exact
        if n:
            plan.policy.committed(row)
        if row.finished:
            continue
        lead = plan.policy.commit_count(row)
        if row.ends_within(lead):  # over: no KV is needed for its last run, emit it without a forward
            _commit(row, lead, tokenizer, plan.settings, in_cache=False)
        else:
            plan.policy.refill(row, lead)  # e.


def _choose(logits: torch.Tensor, mask_slots: list[list[int]], plans: list[RowPlan]) -> list[tuple[list[int], list[int]]]:
    """Each row's fills by its plan's sampler; the rows of one sampler go through it together."""
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


def check_settings(model, settings: DecodeSettings) -> int:
    """The model's mask token, after checking that ``settings`` suit the model (it is no stop token)."""
    check_full_attention(model)
    mask_id = resolve_mask_token_id(model, settings.mask_token_id)
    DecodeSettings.build(settings, mask_token_id=mask_id)  # its checks, with the model's mask token: not a stop token
    return mask_id


def start_row(model, index: int, prompt: list[int], settings: DecodeSettings, mask_id: int) -> RowState:
    """The state of ``prompt`` before its first forward; its window is capped by the token budget."""
    window = 1 if settings.method == AUTOREGRESSIVE else settings.window_size
    check_fits(model, len(prompt), min(window, settings.max_new_tokens))
    return RowState(
        index, prompt, window_size=window, budget=generation_budget(model, len(prompt), settings.max_new_tokens),
        max_new_tokens=settings.max_new_tokens, mask_id=mask_id, stop_ids=frozenset(settings.stop_token_ids),
        autoregressive=settings.method == AUTOREGRESSIVE,
    )


def _commit(row: RowState, n: int, tokenizer, settings: DecodeSettings, in_cache: bool = True) -> None:
    """``row.commit(n)``, then end the row at a stop string (cut the tokens after the one completing it)."""
    checked = len(row.emitted)  # held no stop string, or the row would have ended
    row.commit(n, in_cache)
    if n and settings.stop_strings:
        hit = find_stop_string(tokenizer, row.emitted, settings.stop_strings, checked)
        if hit is not None:
            del row.emitted[hit[0] :]
            row.stop_reason, row.stop_string = STOP_STRING, hit[1]


def row_result(row: RowState, seconds: float, settings: DecodeSettings, tokenizer) -> GenerationResult:
    """``row`` as a result; ``seconds``: the wall clock the caller reports for it."""
    return GenerationResult(
        token_ids=row.emitted,
        num_forwards=row.forwards,
        num_slots=row.slots,
        seconds=seconds,
        method=settings.method,
        stop_reason=row.stop_reason,
        text=decode_text(tokenizer, row.emitted, row.stop_string) if tokenizer is not None else None,
        stop_string=row.stop_string,
    )
