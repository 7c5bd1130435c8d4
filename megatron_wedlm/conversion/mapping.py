"""Which HF tensors make which Megatron tensor, for Qwen2, Qwen3, Llama and Qwen3-MoE.

A :class:`TensorRule` names one Megatron parameter by module name, ``torch_dist`` key (layers
stacked; local-spec norms under TE's names, so both checkpoints interchange) and its HF tensors,
with how they combine (:class:`Combine`); ``tests/test_conversion.py`` checks them against a
real Megatron model. A per-expert rule stands for one tensor per expert: ``EXPERT`` in its
module name is the rank's local expert index, in its HF names the global one, and its
``torch_dist`` key stacks experts after layers (Megatron maps local to global on save).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import torch

from megatron_wedlm.model.hf_config import ModelArgs

from .layout import fuse_gate_up, fuse_qkv, resize_rows, split_gate_up, split_qkv

LAYER = "{layer}"  # placeholder for the global layer index in HF names
EXPERT = "{expert}"  # placeholder for the expert index: local in module names, global in HF names


class Combine(Enum):
    COPY = "copy"  # one HF tensor, same layout
    QKV = "qkv"  # q, k, v -> grouped linear_qkv
    GATE_UP = "gate_up"  # gate, up -> linear_fc1
    VOCAB = "vocab"  # one HF tensor, vocabulary rows padded to Megatron's size


@dataclass(frozen=True)
class TensorRule:
    param: str  # module name; relative to a TransformerLayer when per_layer
    key: str  # torch_dist key (stacked over layers when per_layer)
    hf: tuple[str, ...]  # HF names, with LAYER for per-layer rules
    combine: Combine
    per_layer: bool
    tp_partition_dim: int | None  # None: replicated over tensor parallelism (expert TP if per_expert)
    per_expert: bool = False  # one tensor per expert; EXPERT in param and hf

    def hf_names(self, layer: int | None, expert: int | None = None) -> tuple[str, ...]:
        """The HF tensors of one layer (and global expert, for a per-expert rule)."""
        return tuple(name.replace(LAYER, str(layer)).replace(EXPERT, str(expert)) for name in self.hf)

    @property
    def gated(self) -> bool:
        return self.combine is Combine.GATE_UP


_HF_LAYER = "model.layers.{layer}."


def _layer(
    param: str, key: str, hf: tuple[str, ...], combine: Combine, tp_dim: int | None, per_expert: bool = False
) -> TensorRule:
    return TensorRule(param, f"decoder.layers.{key}", tuple(_HF_LAYER + h for h in hf), combine, True, tp_dim,
                      per_expert)


def _mlp_rules(args: ModelArgs) -> list[TensorRule]:
    """A dense SwiGLU MLP, or Qwen3-MoE's router and per-expert SwiGLU MLPs (no shared expert)."""
    if not args.is_moe:
        return [
            _layer("mlp.linear_fc1.weight", "mlp.linear_fc1.weight",
                   ("mlp.gate_proj.weight", "mlp.up_proj.weight"), Combine.GATE_UP, 0),
            _layer("mlp.linear_fc2.weight", "mlp.linear_fc2.weight", ("mlp.down_proj.weight",), Combine.COPY, 1),
        ]
    local, hf = f"mlp.experts.local_experts.{EXPERT}.", f"mlp.experts.{EXPERT}."
    return [
        _layer("mlp.router.weight", "mlp.router.weight", ("mlp.gate.weight",), Combine.COPY, None),
        _layer(local + "linear_fc1.weight", "mlp.experts.experts.linear_fc1.weight",
               (hf + "gate_proj.weight", hf + "up_proj.weight"), Combine.GATE_UP, 0, per_expert=True),
        _layer(local + "linear_fc2.weight", "mlp.experts.experts.linear_fc2.weight",
               (hf + "down_proj.weight",), Combine.COPY, 1, per_expert=True),
    ]


def layer_rules(args: ModelArgs) -> list[TensorRule]:
    """Rules for the parameters of one transformer layer."""
    attn = "self_attention."
    rules = [
        _layer("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight",
               ("input_layernorm.weight",), Combine.COPY, None),
        _layer(attn + "linear_qkv.weight", "self_attention.linear_qkv.weight",
               ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), Combine.QKV, 0),
        _layer(attn + "linear_proj.weight", "self_attention.linear_proj.weight",
               ("self_attn.o_proj.weight",), Combine.COPY, 1),
        _layer("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight",
               ("post_attention_layernorm.weight",), Combine.COPY, None),
        *_mlp_rules(args),
    ]
    if args.add_qkv_bias:
        rules.append(
            _layer(attn + "linear_qkv.bias", "self_attention.linear_qkv.bias",
                   ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), Combine.QKV, 0)
        )
    if args.qk_layernorm:
        rules += [
            _layer(attn + "q_layernorm.weight", "self_attention.q_layernorm.weight",
                   ("self_attn.q_norm.weight",), Combine.COPY, None),
            _layer(attn + "k_layernorm.weight", "self_attention.k_layernorm.weight",
                   ("self_attn.k_norm.weight",), Combine.COPY, None),
        ]
    return rules


EMBEDDING = TensorRule("embedding.word_embeddings.weight", "embedding.word_embeddings.weight",
                       ("model.embed_tokens.weight",), Combine.VOCAB, False, 0)
FINAL_NORM = TensorRule("decoder.final_layernorm.weight", "decoder.final_layernorm.weight",
                        ("model.norm.weight",), Combine.COPY, False, None)
OUTPUT_LAYER = TensorRule("output_layer.weight", "output_layer.weight", ("lm_head.weight",), Combine.VOCAB, False, 0)


def global_rules(args: ModelArgs) -> list[TensorRule]:
    """Rules for the parameters outside the transformer layers (the output layer only if untied)."""
    return [EMBEDDING, FINAL_NORM] + ([] if args.tie_word_embeddings else [OUTPUT_LAYER])


#: (module name, Transformer Engine name) of the two layer norms. Megatron's local GPT spec stores
#: its norms under the TE names (its ``sharded_state_dict_keys_map``), so local and TE
#: checkpoints interchange; a layer spec without that map stores them under the module names.
#: Both are the same tensor, and loading/reading accepts either.
NORM_KEY_ALIASES = (
    ("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
    ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"),
)


def checkpoint_key_variants(key: str) -> list[str]:
    """``key`` and the other name its tensor may be stored under (see ``NORM_KEY_ALIASES``)."""
    variants = [key]
    for module_name, te_name in NORM_KEY_ALIASES:
        for old, new in ((module_name, te_name), (te_name, module_name)):
            other = re.sub(r"(layers\.(?:\d+\.)?)" + re.escape(old), lambda m: m.group(1) + new, key, count=1)
            if other != key:
                variants.append(other)
    return variants


def zero_hf_tensors(args: ModelArgs, layer: int) -> dict[str, tuple[int, ...]]:
    """One layer's HF tensors that Megatron lacks, so they must be zero: the o_proj bias of
    ``Qwen3ForCausalLM(attention_bias=True)`` and its MoE sibling (absent or zero on import,
    written as zeros).
    """
    if args.architecture in ("qwen3", "qwen3_moe") and args.add_qkv_bias:
        return {f"{_HF_LAYER.format(layer=layer)}self_attn.o_proj.bias": (args.hidden_size,)}
    return {}


#: HF tensors that exist in some checkpoints but carry nothing to convert.
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


def experts_of(rule: TensorRule, args: ModelArgs) -> Sequence[int | None]:
    """The global expert indices a rule stands for: every expert, or ``(None,)`` if not per expert."""
    return range(args.num_experts) if rule.per_expert else (None,)


def split_expert_index(param: str) -> tuple[str, int | None]:
    """A layer parameter's name as a rule writes it (local expert index -> ``EXPERT``), and that index."""
    match = re.search(r"local_experts\.(\d+)\.", param)
    if match is None:
        return param, None
    return param[: match.start(1)] + EXPERT + param[match.end(1):], int(match.group(1))


def all_hf_names(args: ModelArgs) -> list[str]:
    names = [n for rule in global_rules(args) for n in rule.hf_names(None)]
    for layer in range(args.num_layers):
        for rule in layer_rules(args):
            names += [n for expert in experts_of(rule, args) for n in rule.hf_names(layer, expert)]
    return names


# --------------------------------------------------------------------------------------------
# Shapes (full, TP=1 layout) -- used to name the tensor in shape errors
# --------------------------------------------------------------------------------------------


def hf_shapes(rule: TensorRule, args: ModelArgs) -> list[tuple[int, ...]]:
    h, d = args.hidden_size, args.head_dim
    q_rows, kv_rows = args.num_attention_heads * d, args.num_query_groups * d
    param = rule.param
    if rule.combine is Combine.VOCAB:
        return [(args.vocab_size, h)]
    if rule.combine is Combine.QKV:
        tail = (h,) if param.endswith("weight") else ()
        return [(q_rows, *tail), (kv_rows, *tail), (kv_rows, *tail)]
    ffn = args.moe_ffn_hidden_size if rule.per_expert else args.ffn_hidden_size
    if rule.combine is Combine.GATE_UP:
        return [(ffn, h)] * 2
    if param.endswith("linear_proj.weight"):
        return [(h, q_rows)]
    if param.endswith("linear_fc2.weight"):
        return [(h, ffn)]
    if param.endswith("router.weight"):
        return [(args.num_experts, h)]
    if param.endswith(("q_layernorm.weight", "k_layernorm.weight")):
        return [(d,)]
    return [(h,)]  # hidden-size norms


def megatron_shape(rule: TensorRule, args: ModelArgs) -> tuple[int, ...]:
    """Shape of one layer's (and expert's, or the global) tensor in Megatron's full layout."""
    if rule.combine is Combine.VOCAB:
        return (args.padded_vocab_size, args.hidden_size)
    if rule.combine is Combine.QKV:
        return (args.qkv_rows, *hf_shapes(rule, args)[0][1:])
    if rule.combine is Combine.GATE_UP:
        return (2 * hf_shapes(rule, args)[0][0], args.hidden_size)
    return hf_shapes(rule, args)[0]


def stacked_dims(rule: TensorRule, args: ModelArgs) -> tuple[int, ...]:
    """The axes the ``torch_dist`` key stacks before :func:`megatron_shape`: layers, then experts."""
    return (args.num_layers,) * rule.per_layer + (args.num_experts,) * rule.per_expert


# --------------------------------------------------------------------------------------------
# Conversions (full layout)
# --------------------------------------------------------------------------------------------


def to_megatron(rule: TensorRule, hf_tensors: list[torch.Tensor], args: ModelArgs) -> torch.Tensor:
    if rule.combine is Combine.QKV:
        return fuse_qkv(*hf_tensors, num_query_groups=args.num_query_groups)
    if rule.combine is Combine.GATE_UP:
        return fuse_gate_up(*hf_tensors)
    if rule.combine is Combine.VOCAB:
        return resize_rows(hf_tensors[0], args.padded_vocab_size)
    return hf_tensors[0]


def to_hf(rule: TensorRule, tensor: torch.Tensor, args: ModelArgs) -> list[torch.Tensor]:
    if rule.combine is Combine.QKV:
        return list(split_qkv(tensor, args.num_attention_heads, args.num_query_groups, args.head_dim))
    if rule.combine is Combine.GATE_UP:
        return list(split_gate_up(tensor))
    if rule.combine is Combine.VOCAB:
        return [tensor[: args.vocab_size]]
    return [tensor]
