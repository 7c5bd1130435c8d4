"""Load a WeDLM checkpoint as a plain HF causal LM, never with remote code.

Takes this project's exports and the official ``model_type: "wedlm"`` checkpoints, mapped onto
their AR class by ``qk_norm``/``attention_bias``: Qwen3, Qwen2 or Llama (both: Qwen3 with biases).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from megatron_wedlm.runtime.hf_local import (
    WEDLM_MODEL_TYPE,
    checkpoint_mask_token_id,
    checkpoint_tokenizer,
    load_pretrained,
    load_tokenizer,
    read_config,
    wedlm_config_to_hf,
)

__all__ = ["load_tokenizer", "load_wedlm_model", "wedlm_config_to_hf"]  # load_tokenizer, wedlm_config_to_hf: runtime.hf_local

def _zero_missing_output_projection_biases(model, missing_keys) -> None:
    """Zero Qwen3's o_proj bias, which a wedlm checkpoint with q/k/v biases lacks."""
    missing = {name for name in missing_keys if name.endswith("self_attn.o_proj.bias")}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in missing:
                param.zero_()


def load_wedlm_model(
    path: str | Path,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    attn_implementation: str = "sdpa",
    require_mask_token: bool = True,
    place: bool = True,
    device_map: str | dict | None = None,
    max_memory: dict | None = None,
):
    """Load ``path`` in eval mode: by default on CUDA (bf16) if any, else CPU (fp32), with SDPA.

    ``place=False`` (a training engine places it, under ZeRO-3 already partitioned) or
    ``device_map`` leave placement to others; ``device`` then only picks the dtype.
    """
    path = Path(path)
    raw = read_config(path)
    mask_token_id = raw.get("mask_token_id")
    if mask_token_id is None and raw.get("model_type") == WEDLM_MODEL_TYPE:
        # An official checkpoint: its tokenizer may name the mask token (or hold the reference engine's id).
        mask_token_id = checkpoint_mask_token_id(raw, checkpoint_tokenizer(path))
    if require_mask_token and mask_token_id is None:
        raise ValueError(
            f"{path / 'config.json'} has no `mask_token_id`: this is not a WeDLM checkpoint, or its config lacks "
            "the id of the mask token it was trained with (and, for a `wedlm` config, its tokenizer has no mask "
            "token nor the reference engine's default id). Add \"mask_token_id\": <id> to config.json."
        )
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    kwargs = {"dtype": dtype, "attn_implementation": attn_implementation}
    if device_map is not None:
        kwargs.update(device_map=device_map, max_memory=max_memory)
        place = False
    if raw.get("model_type") == WEDLM_MODEL_TYPE:
        model_class, config = wedlm_config_to_hf(raw)
        model, info = load_pretrained(model_class, path, config=config, output_loading_info=True, **kwargs)
        _zero_missing_output_projection_biases(model, info["missing_keys"])
    else:
        model = load_pretrained(AutoModelForCausalLM, path, **kwargs)
    if mask_token_id is not None:
        model.config.mask_token_id = int(mask_token_id)
    return (model.to(device) if place else model).eval()

