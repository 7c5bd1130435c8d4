"""Checkpoint conversion between HF (Qwen2/Qwen3/Llama/Qwen3-MoE, safetensors) and Megatron-Core torch_dist.

:func:`convert_hf_to_megatron` / :func:`convert_megatron_to_hf` are the two directions
(``tools/convert_checkpoint.py``); :func:`load_megatron_weights` loads a converted checkpoint into a
built model of any TP/PP/EP (the weights half of ``model.init_from``).
"""

from .gguf import cached_hf_from_gguf, convert_gguf_to_hf, packaged_file
from .hf_checkpoint import ConversionError
from .hf_to_megatron import convert_hf_to_megatron
from .megatron_checkpoint import build_conversion_model, load_megatron_weights, megatron_process_group
from .megatron_to_hf import convert_megatron_to_hf
from .tokenizer_files import DEFAULT_MASK_TOKEN

__all__ = [
    "ConversionError",
    "DEFAULT_MASK_TOKEN",
    "build_conversion_model",
    "cached_hf_from_gguf",
    "convert_gguf_to_hf",
    "convert_hf_to_megatron",
    "convert_megatron_to_hf",
    "load_megatron_weights",
    "megatron_process_group",
    "packaged_file",
]
