"""Checkpoint conversion between HF (Qwen2 / Qwen3 / Llama, safetensors) and Megatron-Core torch_dist.

* :func:`convert_hf_to_megatron` / :func:`convert_megatron_to_hf` -- the two directions
  (``tools/convert_checkpoint.py`` is their command line).
* :func:`load_megatron_weights` -- load a converted checkpoint into a built Megatron model, any
  TP/PP (the weights half of ``model.init_from``); the model to build is described by
  ``megatron_wedlm.model.hf_config.load_model_args(dir)``.
* :mod:`.mapping` (which HF tensors make which Megatron tensor), :mod:`.layout` (QKV grouping,
  SwiGLU fusion, TP shards), :mod:`.hf_checkpoint` (streaming safetensors read/write),
  :mod:`.megatron_checkpoint` (torch_dist write through a real model, layer-at-a-time read),
  :mod:`.tokenizer_files` (mask token), :mod:`.gguf` (GGUF -> HF directory, cached).
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
