"""HF ``generate`` with KV cache on the same model: the reference the AR rows of the batch
(``method="ar"``) are tested (greedy: same tokens) and benchmarked against, with their metrics.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from transformers import GenerationConfig

from .checks import check_fits, check_full_attention, generation_budget, with_default_stops
from .result import (
    MAX_NEW_TOKENS,
    MAX_POSITIONS,
    STOP_STRING,
    STOP_TOKEN,
    GenerationResult,
    decode_text,
    find_stop_string,
)
from .settings import AUTOREGRESSIVE, DecodeSettings


@torch.inference_mode()
def ar_decode(
    model,
    prompts: list[list[int]],
    settings: DecodeSettings,
    *,
    tokenizer=None,
    generator: torch.Generator | None = None,
    batch_size: int | None = None,
    on_result: Callable[[int, GenerationResult], None] | None = None,
) -> list[GenerationResult]:
    """Prompts in left-padded ``generate`` calls of up to ``batch_size`` rows (default: one call).

    Returns results in the order of ``prompts``; ``on_result(index, result)`` is called as each
    call ends. A call's rows share one budget (``max_new_tokens`` capped by the positions left), so
    with ``batch_size`` prompts are grouped by budget, then length, and a row's output does not
    depend on its neighbours. Parallel-only settings are ignored; ``stop_token_ids`` None: the
    model's EOS ids (:func:`~.checks.eos_token_ids`).
    """
    check_full_attention(model)
    settings = with_default_stops(settings, model, tokenizer)
    for prompt in prompts:
        check_fits(model, len(prompt), 1)
    if batch_size is None:
        batches = [list(range(len(prompts)))]
    else:
        batches = _batches(model, prompts, settings, batch_size)
    results: list[GenerationResult | None] = [None] * len(prompts)
    for batch in batches:
        for i, result in zip(batch, _ar_call(model, [prompts[i] for i in batch], settings, tokenizer, generator)):
            results[i] = result
            if on_result is not None:
                on_result(i, result)
    return results


def _batches(model, prompts: list[list[int]], settings: DecodeSettings, batch_size: int) -> list[list[int]]:
    budgets = [generation_budget(model, len(p), settings.max_new_tokens) for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: (budgets[i], len(prompts[i]), i))
    batches: list[list[int]] = []
    for i in order:
        if batches and len(batches[-1]) < batch_size and budgets[batches[-1][0]] == budgets[i]:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def _ar_call(
    model, prompts: list[list[int]], settings: DecodeSettings, tokenizer, generator: torch.Generator | None
) -> list[GenerationResult]:
    budget = min(generation_budget(model, len(p), settings.max_new_tokens) for p in prompts)
    mask_token_id = settings.mask_token_id
    if mask_token_id is None:
        mask_token_id = getattr(model.config, "mask_token_id", None)
    stops = list(settings.stop_token_ids)
    pad_id = stops[0] if stops else 0
    input_ids, attention_mask = _left_padded(prompts, pad_id, model.device)
    config = _generation_config(settings, budget, stops, pad_id, mask_token_id)
    out, seconds = _timed_generate(model, input_ids, attention_mask, config, tokenizer, generator)
    return [
        _row_result(row, stops, budget, settings, seconds, tokenizer)
        for row in out[:, input_ids.shape[1] :].tolist()
    ]


def _left_padded(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)``, left-padded."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    attention_mask = torch.zeros_like(input_ids)
    for i, prompt in enumerate(prompts):
        input_ids[i, width - len(prompt) :] = torch.tensor(prompt, device=device)
        attention_mask[i, width - len(prompt) :] = 1
    return input_ids, attention_mask


def _generation_config(
    settings: DecodeSettings, budget: int, stops: list[int], pad_id: int, mask_token_id: int | None
) -> GenerationConfig:
    """Every output-changing field, set: ``generate`` fills unset ones from the model's own."""
    sampling = settings.temperature > 0
    return GenerationConfig(
        max_new_tokens=budget,
        do_sample=sampling,
        temperature=settings.temperature if sampling else None,
        top_k=settings.top_k if sampling else None,
        top_p=settings.top_p if sampling else None,
        repetition_penalty=1.0,
        eos_token_id=stops,  # [] = no stop token
        pad_token_id=pad_id,
        suppress_tokens=[int(mask_token_id)] if mask_token_id is not None else None,
        stop_strings=list(settings.stop_strings) if settings.stop_strings else None,
        use_cache=True,
    )


def _timed_generate(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, config: GenerationConfig, tokenizer,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, float]:
    """``model.generate`` and its wall time; HF's global RNG seeded from ``generator`` in a fork."""
    device = model.device
    start = time.perf_counter()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        if generator is not None:
            torch.manual_seed(int(torch.randint(2**62, (1,), generator=generator, device=generator.device)))
        out = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, generation_config=config, tokenizer=tokenizer
        )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - start


def _row_result(
    tokens: list[int], stops: list[int], budget: int, settings: DecodeSettings, seconds: float, tokenizer
) -> GenerationResult:
    stop_strings = settings.stop_strings
    tokens, reason = _cut_at_stop_token(tokens, stops)
    found = find_stop_string(tokenizer, tokens, stop_strings) if stop_strings else None
    if found is not None:
        tokens, reason = tokens[: found[0]], STOP_STRING
    elif reason is None:
        reason = MAX_NEW_TOKENS if budget == settings.max_new_tokens else MAX_POSITIONS
    return GenerationResult(
        token_ids=tokens,
        num_forwards=len(tokens),  # generate stops a row right after its last kept token
        num_slots=len(tokens),
        seconds=seconds,
        method=AUTOREGRESSIVE,
        stop_reason=reason,
        text=decode_text(tokenizer, tokens, found[1] if found else None) if tokenizer is not None else None,
        stop_string=found[1] if found else None,
    )


def _cut_at_stop_token(tokens: list[int], stops: list[int]) -> tuple[list[int], str | None]:
    """Tokens through the first stop token (HF pads a finished row after it)."""
    for i, token in enumerate(tokens):
        if token in stops:
            return tokens[: i + 1], STOP_TOKEN
    return tokens, None
