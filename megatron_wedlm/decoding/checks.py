"""Input normalisation and the checks every decoding method runs before touching the model."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .settings import DecodeSettings


def as_token_list(prompt_ids) -> list[int]:
    """``list[int]``, a 1-D or ``[1, n]`` tensor as a non-empty ``list[int]``."""
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() == 2 and prompt_ids.shape[0] == 1:
            prompt_ids = prompt_ids[0]
        if prompt_ids.dim() != 1:
            raise ValueError(
                f"prompt_ids must be 1-D (or [1, n]); got shape {tuple(prompt_ids.shape)}. "
                "Use generate_batch for several prompts."
            )
        prompt_ids = prompt_ids.tolist()
    tokens = [int(t) for t in prompt_ids]
    if not tokens:
        raise ValueError("prompt_ids is empty: give at least one token (e.g. the BOS token)")
    return tokens


def as_prompt_batch(prompts: Sequence) -> list[list[int]]:
    """Token lists, 1-D tensors or a 2-D tensor as ``list[list[int]]``."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2:
            raise ValueError(f"a prompt batch tensor must be 2-D, got shape {tuple(prompts.shape)}")
        prompts = list(prompts)
    batch = [as_token_list(p) for p in prompts]
    if not batch:
        raise ValueError("the prompt batch is empty")
    return batch


def resolve_mask_token_id(model, mask_token_id: int | None = None) -> int:
    """The explicit mask token, else ``model.config.mask_token_id``; ValueError if neither."""
    if mask_token_id is None:
        mask_token_id = getattr(model.config, "mask_token_id", None)
    if mask_token_id is None:
        raise ValueError(
            "this model has no mask token: its config has no `mask_token_id`. A WeDLM checkpoint stores the id "
            "of the token it was trained to fill in `config.mask_token_id`; set it there or pass mask_token_id=..."
        )
    vocab = model.get_output_embeddings().weight.shape[0]
    if not 0 <= int(mask_token_id) < vocab:
        raise ValueError(f"mask_token_id={mask_token_id} is outside the model vocabulary (size {vocab})")
    return int(mask_token_id)


def eos_token_ids(model, tokenizer=None) -> list[int]:
    """The stop ids when the caller names none: the model's EOS as HF ``generate`` reads it, plus
    the tokenizer's (a chat tokenizer's end of turn). Every entry point stops at these.
    """
    generation = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    model_eos = generation if generation is not None else getattr(getattr(model, "config", None), "eos_token_id", None)
    ids: set[int] = set()
    for source in (model_eos, getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(t) for t in source)
    return sorted(ids)


def with_default_stops(settings: DecodeSettings, model, tokenizer=None) -> DecodeSettings:
    """``settings`` with ``stop_token_ids=None`` replaced by :func:`eos_token_ids`."""
    if settings.stop_token_ids is not None:
        return settings
    return dataclasses.replace(settings, stop_token_ids=tuple(eos_token_ids(model, tokenizer)))


def max_positions(model) -> int | None:
    return getattr(model.config, "max_position_embeddings", None)


def check_fits(model, prompt_length: int, window: int) -> None:
    """Fail when the prompt plus ``window`` positions exceed the model's range."""
    limit = max_positions(model)
    if limit is not None and prompt_length + window > limit:
        raise ValueError(
            f"prompt of {prompt_length} tokens + window of {window} positions exceeds the model's "
            f"max_position_embeddings={limit}; shorten the prompt (or the window / max_new_tokens)"
        )


def generation_budget(model, prompt_length: int, max_new_tokens: int) -> int:
    """``max_new_tokens`` after this prompt, capped by the position range."""
    limit = max_positions(model)
    return max_new_tokens if limit is None else min(max_new_tokens, limit - prompt_length)


def sliding_window_layers(config) -> bool:
    """Whether any layer attends to a window only: a ``layer_types`` entry, or, for a config
    without ``layer_types`` (Qwen3-MoE), a ``sliding_window`` set (HF then windows every layer)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return getattr(config, "sliding_window", None) is not None
    return any(t != "full_attention" for t in layer_types)


def check_full_attention(model) -> None:
    """Refuse sliding-window layers (the decoders assume full-prefix attention)."""
    if sliding_window_layers(model.config):
        kinds = sorted(set(getattr(model.config, "layer_types", None) or ["sliding_attention"]))
        raise ValueError(
            f"model has non-full-attention layers {kinds}; WeDLM decoding supports "
            "full causal attention only (disable use_sliding_window in the config)"
        )
