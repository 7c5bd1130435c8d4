"""Streaming parallel decoding (WeDLM Algorithm 1) and the block-wise baseline, for a batch of prompts.

The engine is split as nano-vllm's: per-row state (:class:`~.state.RowState`), a commit policy
per schedule (:mod:`.policy`: streaming commits the leftmost filled run, block-wise a whole
filled block), the tensors and the forward (:class:`~.model_runner.ModelRunner`), the fill rule
and sampler (:class:`~.sampling.SlotSampler`), and the continuous batch whose step reads like
Algorithm 1 (:mod:`.batch`). :func:`decode` adds every prompt to one batch and steps until it is
empty; AR rows (``method="ar"``, one next-token slot per forward) go through the same batch.

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
  step, the leftmost filled run already reaches a stop token, a stop string or the token budget,
  it is emitted without one more forward (AR decoding does not forward its last sampled token either).
  The output is the same as committing it in a further forward.
* Rows of a batch are independent: each has its own window, cache length and budget; finished
  rows leave the batch, and with ``batch_rows`` the next prompts join it in their places. Greedy
  results equal one-at-a-time decoding (tests/test_decoding.py checks it for several batch sizes
  and orders on CPU in fp32; in bf16 on a GPU, kernels chosen by batch shape can round
  differently, which can flip a near-tie).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from .batch import RowBatch, RowPlan, check_settings, row_result, start_row
from .checks import with_default_stops
from .model_runner import ModelRunner
from .result import GenerationResult
from .settings import DecodeSettings


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
    """Decode ``prompts`` together with ``settings.method`` (``"streaming"``, ``"blockwise"`` or ``"ar"``).

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
    settings = with_default_stops(settings, model, tokenizer)
    mask_id = check_settings(model, settings)
    plan = RowPlan(settings, tokenizer, generator)
    rows = [start_row(model, index, prompt, plan, mask_id) for index, prompt in enumerate(prompts)]
    size = len(rows) if batch_rows is None else batch_rows
    if size < 1:
        raise ValueError(f"batch_rows must be at least 1, got {batch_rows}")
    with ModelRunner.for_rows(model, rows, plan.settings.window_size, batch_rows=size) as runner:
        batch = RowBatch(runner, size, tokenizer)
        for row in rows:
            batch.add(row)
        while batch:
            ended = batch.step()
            if on_result is not None:
                for row in ended:
                    on_result(row.index, row_result(row, time.perf_counter() - start, tokenizer))

    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    seconds = time.perf_counter() - start
    return [row_result(row, seconds, tokenizer) for row in rows], runner
