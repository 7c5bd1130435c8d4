"""From the ``model`` config section to this rank's WeDLM model chunk.

The architecture is one :class:`megatron_wedlm.model.hf_config.ModelArgs`, read from the
``wedlm_model.json`` of ``model.init_from`` or assembled from the config, and written into every
checkpoint, so ``megatron-to-hf`` and later runs rebuild exactly this model. AR mode uses the same
model on memory-stream rows.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from megatron_wedlm.config.schema import ConfigError, ModelConfig, TrainConfig
from megatron_wedlm.model.attention_backends import resolve_attention_backend
from megatron_wedlm.model.hf_config import ModelArgs, load_model_args, pad_vocab_size
from megatron_wedlm.model.moe import MoESettings

if TYPE_CHECKING:
    from megatron_wedlm.model.wedlm_model import BuildSettings

__all__ = ["build_settings", "load_init_weights", "moe_settings", "recorded_model", "resolve_model_args"]

# model config key -> ModelArgs field, for the keys that describe the architecture
_ARCH_FIELDS = {
    "architecture": "architecture",
    "num_layers": "num_layers",
    "hidden_size": "hidden_size",
    "ffn_hidden_size": "ffn_hidden_size",
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_query_groups",
    "head_dim": "head_dim",
    "max_position_embeddings": "max_position_embeddings",
    "rope_theta": "rope_theta",
    "rms_norm_eps": "rms_norm_eps",
    "qk_layernorm": "qk_layernorm",
    "add_qkv_bias": "add_qkv_bias",
    "tie_word_embeddings": "tie_word_embeddings",
    "num_experts": "num_experts",
    "moe_ffn_hidden_size": "moe_ffn_hidden_size",
    "moe_topk": "moe_topk",
    "moe_norm_topk_prob": "moe_norm_topk_prob",
}


def resolve_model_args(cfg: TrainConfig, manifest: dict[str, Any], dtype: str) -> ModelArgs:
    """The model description for this run (``cfg`` is left as given). Checks that the data's mask
    token has an embedding row and that the vocabulary covers the tokenizer."""
    m = replace(cfg.model)  # null keys filled below from the checkpoint or the defaults
    mask_id = int(manifest["mask_token_id"])
    tokenizer_length = int(manifest["tokenizer_length"])
    if m.init_from is not None:
        args = load_model_args(m.init_from)
        for key, field_name in _ARCH_FIELDS.items():
            given, stored = getattr(m, key), getattr(args, field_name)
            if given is not None and given != stored:
                raise ConfigError(
                    f"model.{key}={given!r} disagrees with {field_name}={stored!r} in the wedlm_model.json of "
                    f"model.init_from={m.init_from}; remove model.{key} (it is read from the checkpoint)"
                )
            setattr(m, key, stored)
        if m.vocab_size is not None and m.vocab_size != args.vocab_size:
            raise ConfigError(
                f"model.vocab_size={m.vocab_size} disagrees with vocab_size={args.vocab_size} of model.init_from"
            )
        m.vocab_size = args.vocab_size
        if args.mask_token_id is not None and args.mask_token_id != mask_id:
            raise ConfigError(
                f"the checkpoint in model.init_from records mask_token_id={args.mask_token_id} but the data in "
                f"data.path was tokenized with mask token id {mask_id}; prepare the data with the tokenizer "
                "saved next to the converted checkpoint"
            )
        args.mask_token_id = mask_id
        args.dtype = dtype
    else:
        heads = int(m.num_attention_heads)  # type: ignore[arg-type]
        defaults = {
            "num_query_groups": heads,
            "head_dim": int(m.hidden_size) // heads,  # type: ignore[arg-type]
            "max_position_embeddings": cfg.data.seq_length,
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-6,
            "qk_layernorm": m.architecture in ("qwen3", "qwen3_moe"),
            "add_qkv_bias": m.architecture == "qwen2",
            "tie_word_embeddings": False,
            "moe_norm_topk_prob": False,
        }
        for key, value in defaults.items():
            if getattr(m, key) is None:
                setattr(m, key, value)
        if m.vocab_size is None:
            m.vocab_size = tokenizer_length
        args = ModelArgs(
            **{field_name: getattr(m, key) for key, field_name in _ARCH_FIELDS.items()},
            vocab_size=int(m.vocab_size),
            padded_vocab_size=pad_vocab_size(int(m.vocab_size), m.make_vocab_size_divisible_by),
            mask_token_id=mask_id,
            dtype=dtype,
            make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
        )
    ep = cfg.parallelism.ep
    if (ep > 1 or cfg.parallelism.etp is not None) and not args.is_moe:
        raise ConfigError(
            f"parallelism.ep={ep} / etp={cfg.parallelism.etp} split experts, and the model ({args.architecture}) has "
            "none; remove them or train a MoE model (qwen3_moe)"
        )
    if args.is_moe and args.num_experts % ep:
        raise ConfigError(f"parallelism.ep={ep} must divide the model's {args.num_experts} experts")
    if args.vocab_size < tokenizer_length:
        raise ConfigError(
            f"the model's vocabulary ({args.vocab_size}) is smaller than the data's tokenizer "
            f"({tokenizer_length} tokens, mask token included); raise model.vocab_size or convert the "
            "checkpoint with the tokenizer that tools/prepare_data.py saved"
        )
    if not 0 <= mask_id < args.vocab_size:
        raise ConfigError(f"mask token id {mask_id} has no embedding row in a vocabulary of {args.vocab_size}")
    if cfg.wedlm.enabled and cfg.data.seq_length // 2 > args.max_position_embeddings:
        raise ConfigError(
            f"a WeDLM row of data.seq_length={cfg.data.seq_length} holds positions up to "
            f"{cfg.data.seq_length // 2}, beyond max_position_embeddings={args.max_position_embeddings}"
        )
    return args


def recorded_model(model: ModelConfig, args: ModelArgs) -> ModelConfig:
    """The ``model`` section as the run records it: ``model`` with the architecture keys and the
    vocabulary of ``args``, the model the run builds."""
    architecture = {key: getattr(args, name) for key, name in _ARCH_FIELDS.items()}
    return replace(model, vocab_size=args.vocab_size, **architecture)


def build_settings(cfg: TrainConfig, device: torch.device, params_dtype: torch.dtype) -> BuildSettings:
    """How this run builds its model: the config's layout features, recompute, init and attention
    backend, on ``device`` in ``params_dtype``."""
    from megatron_wedlm.model.wedlm_model import BuildSettings  # imports Megatron-Core

    p = cfg.parallelism
    return BuildSettings(
        params_dtype=params_dtype,
        device=device,
        sequence_parallel=p.sequence_parallel,
        recompute=p.recompute,
        recompute_num_layers=p.recompute_num_layers,
        init_method_std=cfg.model.init_method_std,
        attention_backend=resolve_attention_backend(cfg.model.attention_backend, device),
        moe=moe_settings(cfg.model, device),
    )


def moe_settings(model: ModelConfig, device: torch.device) -> MoESettings:
    """How this run trains a MoE model's routers and experts (``model.moe_*``); grouped GEMM by
    default where it runs: a GPU with Transformer Engine."""
    grouped = model.moe_grouped_gemm
    if grouped is None:
        grouped = device.type == "cuda" and importlib.util.find_spec("transformer_engine") is not None
    return MoESettings(aux_loss_coeff=model.moe_aux_loss_coeff, z_loss_coeff=model.moe_z_loss_coeff,
                       load_balancing=model.moe_load_balancing, capacity_factor=model.moe_capacity_factor,
                       grouped_gemm=grouped)


def load_init_weights(model, directory: str | Path) -> None:
    """``model.init_from``: the weights of a converted HF (or training) checkpoint, any TP/PP
    (``strict=False``: a training checkpoint's common state comes back too)."""
    from megatron_wedlm.conversion.megatron_checkpoint import load_megatron_weights  # imports safetensors

    load_megatron_weights(model, directory, strict=False)
