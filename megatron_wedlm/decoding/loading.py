"""Load a WeDLM checkpoint as a plain HF causal LM, never with remote code.

Two kinds of directories are accepted:

* this project's exports: an ordinary ``qwen2`` / ``qwen3`` / ``llama`` HF directory whose
  ``config.json`` also holds ``mask_token_id``; loaded with ``AutoModelForCausalLM``.
* the official WeDLM checkpoints (``model_type: "wedlm"``). Their architecture is the AR model
  they were initialised from, with the same weight names, so the config is mapped onto the
  matching transformers class:

  ============  ===============  =====================================================
  ``qk_norm``   ``attention_bias``  transformers class
  ============  ===============  =====================================================
  true          false (default)  ``Qwen3ForCausalLM`` (WeDLM-8B, from Qwen3-8B)
  false         true (default)   ``Qwen2ForCausalLM`` (WeDLM-7B, from Qwen2.5-7B)
  false         false            ``LlamaForCausalLM`` (no biases, no q/k norm)
  true          true             ``Qwen3ForCausalLM`` with ``attention_bias=True`` (q/k/v
                                 biases and q/k norm, as the reference ``WeDLMAttention``
                                 builds it); that class also has an output-projection bias
                                 the checkpoint lacks, which is set to zero -- the same function
  ============  ===============  =====================================================

  (``attention_bias`` defaults to true when absent, as in the WeDLM config class.)
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
    """A wedlm checkpoint with q/k norm and q/k/v biases has no o_proj bias; Qwen3's class does: make it zero."""
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
    """Load ``path`` in eval mode. Defaults: CUDA if available (bf16) else CPU (fp32), SDPA attention.

    ``require_mask_token=False`` allows plain AR checkpoints (for the AR baseline, and for
    training, which adds the mask token itself). ``place=False`` leaves the model where
    ``from_pretrained`` put it (``device`` then only picks the default dtype): a training
    engine such as DeepSpeed places it, and under ZeRO-3 initialisation its parameters are
    already partitioned, so moving them here would be wrong. ``device_map`` (e.g. ``"auto"``,
    with ``max_memory`` per device) spreads a model too big for one GPU over several
    (``from_pretrained``'s placement; ``device`` then only picks the default dtype).
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

