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
(:func:`~.sampling.select_slots`). Whether the tokenizer's EOS is a stop
token is the caller's choice (``stop_token_ids``); the command lines stop at it by default, as
the engine does.

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

import time
from collections import deque
from collections.abc import Callable

import torch

from .checks import check_fits, check_full_attention, generation_budget, resolve_mask_token_id
from .model_runner import ModelRunner
from .policy import commit_policy
from .result import STOP_STRING, GenerationResult, decode_text, find_stop_string
from .sampling import SlotSampler, stop_token_vocabulary
from .settings import DecodeSettings
from .state import RowState


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
    rows = _start_rows(model, prompts, settings)
    policy = commit_policy(settings)
    stop_vocabulary = (stop_token_vocabulary(tokenizer, settings.stop_token_ids, settings.stop_strings)
                       if settings.stop_penalty else ())
    sampler = SlotSampler(settings, generator, stop_vocabulary)
    size = len(rows) if batch_rows is None else batch_rows
    if size < 1:
        raise ValueError(f"batch_rows must be at least 1, got {batch_rows}")
    live, waiting = rows[:size], deque(rows[size:])
    with ModelRunner(model, rows, settings.window_size, batch_rows=size) as runner:
        while live:
            commits = [policy.commit_count(row) for row in live]  # c. decided by what this forward feeds
            logits, mask_slots = runner.forward(live)  # a, b. reordered windows, one causal forward
            fills = sampler.choose(logits, mask_slots)  # d. entropy rule on the masks of this forward
            for row, n, (slots, tokens) in zip(live, commits, fills):
                row.fill(slots, tokens)
                _commit(row, n, tokenizer, settings)  # c. the leftmost filled run: its KV is exact
                if n:
                    policy.committed(row)
                if row.finished:
                    continue
                lead = policy.commit_count(row)
                if row.ends_within(lead):  # over: no KV is needed for its last run, emit it without a forward
                    _commit(row, lead, tokenizer, settings, in_cache=False)
                else:
                    policy.refill(row, lead)  # e.
            if on_result is not None:
                for row in live:
                    if row.finished:
                        on_result(row.index, _result(row, time.perf_counter() - start, settings, tokenizer))
            free = size - sum(not row.finished for row in live)  # finished rows' places go to the next prompts
            live = runner.advance(live, [waiting.popleft() for _ in range(min(free, len(waiting)))])

    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    seconds = time.perf_counter() - start
    return [_result(row, seconds, settings, tokenizer) for row in rows], runner


def _start_rows(model, prompts: list[list[int]], settings: DecodeSettings) -> list[RowState]:
    check_full_attention(model)
    mask_id = resolve_mask_token_id(model, settings.mask_token_id)
    DecodeSettings.build(settings, mask_token_id=mask_id)  # its checks, with the model's mask token: not a stop token
    rows = []
    for index, prompt in enumerate(prompts):
        check_fits(model, len(prompt), min(settings.window_size, settings.max_new_tokens))
        rows.append(RowState(
            index, prompt, window_size=settings.window_size,
            budget=generation_budget(model, len(prompt), settings.max_new_tokens),
            max_new_tokens=settings.max_new_tokens, mask_id=mask_id, stop_ids=frozenset(settings.stop_token_ids),
        ))
    return rows


def _commit(row: RowState, n: int, tokenizer, settings: DecodeSettings, in_cache: bool = True) -> None:
    """``row.commit(n)``, then end the row at a stop string (cut the tokens after the one completing it)."""
    row.commit(n, in_cache)
    if n and settings.stop_strings:
        hit = find_stop_string(tokenizer, row.emitted, settings.stop_strings)
        if hit is not None:
            del row.emitted[hit[0] :]
            row.stop_reason, row.stop_string = STOP_STRING, hit[1]


def _result(row: RowState, seconds: float, settings: DecodeSettings, tokenizer) -> GenerationResult:
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
