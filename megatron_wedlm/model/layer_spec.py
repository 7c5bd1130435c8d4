"""Megatron-Core ``ModuleSpec``s for a WeDLM decoder layer and block.

The layer is Megatron's local GPT layer (``get_gpt_layer_local_spec``) with two swaps:

* core attention -> a WeDLM backend that applies the dual-stream mask: the ``ModuleSpec`` of
  the backend's row in :mod:`.attention_backends` (module and params, e.g. ``tile_size``);
* norms -> :class:`.norms.WeDLMNorm`, which supports sequence parallelism on any device.

Everything else -- ``ColumnParallelLinear`` QKV (GQA, optional QKV bias), QK-norm, RoPE
application, SwiGLU MLP, bias-dropout-add -- is Megatron's own, and the module tree (hence
every parameter name) is identical to the local spec's, so Megatron / HF conversions written
for standard GPT checkpoints map 1:1.
"""

from __future__ import annotations

from typing import Any

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from .attention_backends import get_attention_backend
from .norms import WeDLMNorm

__all__ = ["get_wedlm_block_spec", "get_wedlm_layer_spec"]


def get_wedlm_layer_spec(
    attention_backend: str = "dense", qk_layernorm: bool = False, **backend_options: Any
) -> ModuleSpec:
    """A ``TransformerLayer`` spec whose attention applies the WeDLM mask.

    ``attention_backend``: a name of :data:`.attention_backends.ATTENTION_BACKENDS` (resolved,
    not ``auto``); ``backend_options`` override that backend's ``ModuleSpec`` params by name
    (e.g. ``tile_size``). ``qk_layernorm`` adds per-head norms on queries and keys (Qwen3); the
    norm kind (RMSNorm / LayerNorm) follows ``config.normalization``. QKV bias (Qwen2) and GQA
    come from the ``TransformerConfig`` (``add_qkv_bias``, ``num_query_groups``).
    """
    core_attention = get_attention_backend(attention_backend).core_attention_spec(**backend_options)
    qk_norm = WeDLMNorm if qk_layernorm else IdentityOp
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=WeDLMNorm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.arbitrary},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=core_attention,
                    linear_proj=RowParallelLinear,
                    q_layernorm=qk_norm,
                    k_layernorm=qk_norm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=WeDLMNorm,
            mlp=ModuleSpec(
                module=MLP,
                submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            ),
            mlp_bda=get_bias_dropout_add,
            # Store the norms under the names Megatron's local and TE GPT specs use, so WeDLM
            # checkpoints and standard Megatron GPT checkpoints load into each other.
            sharded_state_dict_keys_map={
                "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
            },
        ),
    )


def get_wedlm_block_spec(
    config, attention_backend: str = "dense", vp_stage: int | None = None, **backend_options: Any
) -> TransformerBlockSubmodules:
    """The decoder block for this pipeline stage: WeDLM layers plus a WeDLM final norm.

    Why a block spec and not just a layer spec: given a layer spec, Megatron picks the final
    norm from a module-level default (``WrappedTorchNorm`` without TE/Apex), which refuses
    sequence parallelism.
    """
    layer = get_wedlm_layer_spec(attention_backend, bool(config.qk_layernorm), **backend_options)
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=WeDLMNorm)
