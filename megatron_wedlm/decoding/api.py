"""One entry point for the three decoding methods, so callers (CLI, evaluation, benchmarks) switch by name."""

from __future__ import annotations

from .autoregressive import AUTOREGRESSIVE, ar_generate_batch
from .checks import as_token_list
from .parallel import BLOCKWISE, STREAMING, parallel_generate_batch
from .result import GenerationResult

METHODS = (STREAMING, BLOCKWISE, AUTOREGRESSIVE)
PARALLEL_ONLY = ("window_size", "entropy_threshold", "distance_penalty", "fused_refill")


def generate_batch(model, prompts, method: str = STREAMING, **kwargs) -> list[GenerationResult]:
    """Decode a batch of prompts with ``method`` in ``("streaming", "blockwise", "ar")``.

    Keyword arguments are those of ``streaming_generate``; the parallel-only ones
    (window size, entropy threshold, distance penalty, refill order) are ignored for ``"ar"`` so one settings
    dict can drive all methods.
    """
    if method == AUTOREGRESSIVE:
        return ar_generate_batch(model, prompts, **{k: v for k, v in kwargs.items() if k not in PARALLEL_ONLY})
    if method in (STREAMING, BLOCKWISE):
        return parallel_generate_batch(model, prompts, schedule=method, **kwargs)
    raise ValueError(f"unknown decoding method {method!r}; choose one of {METHODS}")


def generate(model, prompt_ids, method: str = STREAMING, **kwargs) -> GenerationResult:
    """Decode one prompt with ``method``; see :func:`generate_batch`."""
    return generate_batch(model, [as_token_list(prompt_ids)], method=method, **kwargs)[0]
