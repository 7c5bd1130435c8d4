"""One entry point for the three decoding methods, so callers (CLI, evaluation, benchmarks) switch by name.

Every function takes one :class:`DecodeSettings` and/or keyword overrides of its fields
(``generate(model, ids, method="blockwise", window_size=8)``), plus the runtime objects
``tokenizer`` (needed for stop strings and ``text``) and ``generator`` (seeded sampling).

A reply stops where HF ``generate`` stops it: at the model's EOS ids (its ``generation_config``),
and at the tokenizer's EOS when a tokenizer is passed (a chat tokenizer's end of turn), unless
``stop_token_ids`` names others; ``stop_token_ids=()`` decodes to ``max_new_tokens`` without a stop.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .checks import as_prompt_batch, as_token_list
from .parallel import decode
from .result import GenerationResult
from .settings import DecodeSettings


def generate_batch(
    model,
    prompts,
    settings: DecodeSettings | None = None,
    *,
    tokenizer=None,
    generator: torch.Generator | None = None,
    batch_size: int | None = None,
    on_result: Callable[[int, GenerationResult], None] | None = None,
    **overrides,
) -> list[GenerationResult]:
    """Decode several prompts (of any lengths) together; one result per prompt, in order.

    ``settings.method``: ``"streaming"`` (default), ``"blockwise"`` or ``"ar"``; the parallel-only
    settings are ignored by ``"ar"`` so one settings object can drive all methods.
    ``batch_size`` (default: all prompts at once) caps the rows decoded together; every method keeps
    the batch full: a finished row's place goes to the next prompt (:func:`~.parallel.decode`). AR
    rows are next-token rows of the same batch, as the server decodes them; greedy, they equal HF
    ``generate`` token for token (``autoregressive.ar_decode``, the reference in the tests) and keep
    its pace (``tools/bench_decode.py``). ``on_result(index, result)`` is called as each prompt finishes.
    """
    settings = DecodeSettings.build(settings, **overrides)
    if settings.stop_strings and tokenizer is None:
        raise ValueError("stop_strings need a tokenizer (pass tokenizer=...)")
    prompts = as_prompt_batch(prompts)
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    return decode(model, prompts, settings, tokenizer=tokenizer, generator=generator, batch_rows=batch_size,
                  on_result=on_result)[0]


def generate(model, prompt_ids, settings: DecodeSettings | None = None, **kwargs) -> GenerationResult:
    """Decode one prompt (``list[int]``, 1-D or ``[1, n]`` tensor); see :func:`generate_batch`."""
    return generate_batch(model, [as_token_list(prompt_ids)], settings, **kwargs)[0]

