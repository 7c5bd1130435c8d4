"""Megatron-Core ``ModuleSpec``s for a WeDLM decoder layer and block.

Megatron's local GPT layer with two swaps: core attention by the backend table's
``ModuleSpec`` (:mod:`.attention_backends`) and norms by :class:`.norms.WeDLMNorm`. The module
tree, hence every parameter name, equals the local spec's, so GPT conversions map 1:1.
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
from .moe import moe_mlp_spec
from .norms import WeDLMNorm

__all__ = ["get_wedlm_block_spec", "get_wedlm_layer_spec"]


def get_wedlm_layer_spec(
    attention_backend: str = "dense", qk_layernorm: bool = False, mlp: ModuleSpec | None = None,
    **backend_options: Any
) -> ModuleSpec:
    """A ``TransformerLayer`` spec whose attention applies the WeDLM mask; ``attention_backend``: a
    resolved name, ``backend_options``: its params by name, ``qk_layernorm``: Qwen3's q/k norms;
    ``mlp``: the MLP's spec (default: a dense SwiGLU MLP; :func:`.moe.moe_mlp_spec` for experts).
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
            mlp=mlp or ModuleSpec(
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
    """This pipeline stage's decoder block: WeDLM layers and a WeDLM final norm (Megatron's default
    ``WrappedTorchNorm`` refuses sequence parallelism).
    """
    mlp = moe_mlp_spec(config.num_moe_experts, bool(config.moe_grouped_gemm)) if config.num_moe_experts else None
    layer = get_wedlm_layer_spec(attention_backend, bool(config.qk_layernorm), mlp, **backend_options)
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=WeDLMNorm)
