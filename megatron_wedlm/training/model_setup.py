"""From the ``model`` config section to this rank's WeDLM model chunk.

The architecture is described once, as :class:`megatron_wedlm.model.hf_config.ModelArgs`: read
from the ``wedlm_model.json`` of ``model.init_from`` (a converted HF checkpoint or a training
checkpoint) or assembled from the config for a model trained from scratch. The same record is
written into every training checkpoint, so ``megatron-to-hf`` and later runs rebuild exactly
this model.

AR mode (``wedlm.enabled=false``) uses the same model: its rows hold only the memory stream, on
which the WeDLM attention rule is ordinary causal attention inside each document.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megatron_wedlm.config.schema import ConfigError, TrainConfig
from megatron_wedlm.model.hf_config import ModelArgs, load_model_args, pad_vocab_size

__all__ = [
    "ModelChunks", "build_model_chunk", "build_model_chunks", "load_init_weights", "resolve_model_args",
]

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
}


def resolve_model_args(cfg: TrainConfig, manifest: dict[str, Any], dtype: str) -> ModelArgs:
    """The model description for this run; fills the config's null model keys in place.

    Checks that the data's mask token has an embedding row and that the vocabulary covers the
    tokenizer. ``dtype`` is the training precision name ('float32' or 'bfloat16').
    """
    m = cfg.model
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
            "qk_layernorm": m.architecture == "qwen3",
            "add_qkv_bias": m.architecture == "qwen2",
            "tie_word_embeddings": False,
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


def _recompute_overrides(cfg: TrainConfig) -> dict[str, Any]:
    mode = cfg.parallelism.recompute
    if mode == "full":
        return dict(recompute_granularity="full", recompute_method="uniform",
                    recompute_num_layers=cfg.parallelism.recompute_num_layers)
    if mode == "selective":
        return dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    return {}


class ModelChunks(list):
    """This rank's model chunks: one, or one per virtual pipeline stage (``parallelism.virtual_pp``).

    Checkpointing and ``model.init_from`` treat it as one model: its sharded state holds every
    chunk's tensors under their global keys (one chunk: exactly that chunk's state, so
    checkpoints of any layout load into any other).
    """

    def sharded_state_dict(self) -> dict[str, Any]:
        if len(self) == 1:
            return self[0].sharded_state_dict()
        return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(self)}

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        if len(self) == 1:
            self[0].load_state_dict(state, strict=strict)
            return
        for i, chunk in enumerate(self):
            chunk.load_state_dict(state[f"model{i}"], strict=strict)


def build_model_chunks(cfg: TrainConfig, args: ModelArgs, device: torch.device, params_dtype: torch.dtype) -> ModelChunks:
    """This rank's model: its virtual-pipeline chunks (interleaved schedule), or its one chunk."""
    from megatron.core import parallel_state as ps

    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    stages: list[int | None] = [None] if vpp is None else list(range(vpp))
    return ModelChunks(build_model_chunk(cfg, args, device, params_dtype, vp_stage=stage) for stage in stages)


def build_model_chunk(
    cfg: TrainConfig, args: ModelArgs, device: torch.device, params_dtype: torch.dtype, vp_stage: int | None = None
):
    """This rank's ``WeDLMGPTModel`` (unwrapped; ``vp_stage``: which virtual-pipeline chunk), on
    ``device``, in ``params_dtype``."""
    from megatron.core import parallel_state as ps

    from megatron_wedlm.model.attention_backends import resolve_attention_backend
    from megatron_wedlm.model.hf_config import transformer_config_from_model_args
    from megatron_wedlm.model.wedlm_model import WeDLMModelArgs, build_wedlm_model

    tp = ps.get_tensor_model_parallel_world_size()
    if args.padded_vocab_size % tp:
        raise ConfigError(
            f"the padded vocabulary ({args.padded_vocab_size}) does not split over parallelism.tp={tp}"
        )
    config = transformer_config_from_model_args(
        args,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        context_parallel_size=ps.get_context_parallel_world_size(),
        virtual_pipeline_model_parallel_size=ps.get_virtual_pipeline_model_parallel_world_size(),
        params_dtype=params_dtype,
        sequence_parallel=cfg.parallelism.sequence_parallel,
        init_method_std=cfg.model.init_method_std,
        use_cpu_initialization=device.type == "cpu",
        bias_dropout_fusion=device.type == "cuda",
        **_recompute_overrides(cfg),
    )
    model = build_wedlm_model(
        config,
        WeDLMModelArgs(
            vocab_size=args.padded_vocab_size,
            max_sequence_length=args.max_position_embeddings,
            mask_token_id=int(args.mask_token_id),  # type: ignore[arg-type]
            attention_backend=resolve_attention_backend(cfg.model.attention_backend, device),
            share_embeddings_and_output_weights=args.tie_word_embeddings,
            rotary_base=args.rope_theta,
            extra={"architecture": args.architecture},
        ),
        vp_stage=vp_stage,
    )
    return model.to(device)


def load_init_weights(model, directory: str | Path) -> None:
    """``model.init_from``: the weights of a converted HF (or training) checkpoint, any TP/PP.

    ``strict=False`` only because a training checkpoint's common state (optimizer, RNG) comes
    back with the requested weights; every parameter is requested as a sharded tensor, and
    ``dist_checkpointing`` raises if the checkpoint lacks one.
    """
    from megatron_wedlm.conversion.megatron_checkpoint import load_megatron_weights

    load_megatron_weights(model, directory, strict=False)
