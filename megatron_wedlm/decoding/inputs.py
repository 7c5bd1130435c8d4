"""Loading by dtype name and prompt encoding, shared by the command lines and evaluation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .checks import eos_token_ids  # noqa: F401  (defined beside the engine, which stops at them by default)
from .loading import load_tokenizer, load_wedlm_model

#: dtype names accepted by ``--dtype`` (``auto``: bf16 on CUDA, fp32 on CPU).
DTYPES: dict[str, torch.dtype | None] = {
    "auto": None, "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
}


def load_checkpoint(
    path: str | Path, device: str | None = None, dtype: str = "auto", require_mask_token: bool = True,
    **placement: Any,
) -> tuple[Any, Any]:
    """(model, tokenizer) of a local checkpoint; ``dtype``: a name of :data:`DTYPES`; ``placement``:
    ``device_map``/``max_memory``; ``require_mask_token=False`` admits plain AR checkpoints.
    """
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    model = load_wedlm_model(path, device=device, dtype=DTYPES[dtype], require_mask_token=require_mask_token,
                             **placement)
    return model, load_tokenizer(path)


def chat_text(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """``messages`` in the chat template, up to where the reply begins."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "chat prompts need a chat template, and this tokenizer has none: drop the chat option or add a "
            "chat_template to tokenizer_config.json"
        )
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def chat_prompt_text(tokenizer: Any, prompt: str) -> str:
    """``prompt`` as one user turn in the chat template, up to where the reply begins."""
    return chat_text(tokenizer, [{"role": "user", "content": prompt}])


def encode_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    return list(tokenizer(chat_text(tokenizer, messages), add_special_tokens=False)["input_ids"])


def encode_prompt(tokenizer: Any, prompt: str, chat: bool = False) -> list[int]:
    """Token ids of ``prompt``; ``chat`` wraps it as one user turn."""
    if not chat:
        return list(tokenizer(prompt)["input_ids"])
    return encode_chat(tokenizer, [{"role": "user", "content": prompt}])


def find_mask_token_id(model: Any, tokenizer: Any, mask_token_id: int | None = None) -> int | None:
    """The explicit id, else the model config's mask token, else the tokenizer's, else None."""
    if mask_token_id is not None:
        return int(mask_token_id)
    from_config = getattr(getattr(model, "config", None), "mask_token_id", None)
    if from_config is not None:
        return int(from_config)
    return getattr(tokenizer, "mask_token_id", None)
