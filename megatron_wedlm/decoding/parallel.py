"""Streaming (WeDLM Algorithm 1) and block-wise parallel decoding of a batch of prompts.

The rules and step orders: docs/method.md §3.2-§3.6.
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
    """Decode ``prompts`` with ``settings.method`` (``"streaming"``, ``"blockwise"`` or ``"ar"``).

    At most ``batch_rows`` rows at once (default all); finished rows make room for the next
    prompts, and a row's result does not depend on its neighbours. ``on_result(index, result)`` as
    each finishes. Returns the results in order and the runner (cache, ``steps``).
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
