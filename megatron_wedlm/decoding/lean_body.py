"""The decoding step's body for Llama, Qwen2, Qwen3 and Qwen3-MoE without HF's per-module Python.

:class:`LeanBody` runs HF's weights and operations in HF's order (hidden states equal bit for bit,
tested per family); one-token steps use ``torch.mv``, and decoding-sized steps of a bf16 model on
CPU oneDNN-packed weights (cpu_gemm.py, the same bits). A Qwen3-MoE layer's expert block is HF's own
module, called as HF's layer calls it: its routing and expert kernel (``_experts_implementation``)
stay HF's. Packed (SDPA) decoding only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .checks import sliding_window_layers
from .cpu_gemm import Packed, pack, plain_linear
from .packed_attention import Packing, packed_sdpa
from .row_cache import RowKVCache

# the HF body classes whose layers are written out here
FAMILIES = ("LlamaModel", "Qwen2Model", "Qwen3Model", "Qwen3MoeModel")


class _Linear(NamedTuple):
    weight: torch.Tensor
    bias: torch.Tensor | None
    packed: Packed | None  # for steps of up to cpu_gemm.PACKED_ROWS tokens, where it applies


class _Norm(NamedTuple):
    weight: torch.Tensor
    eps: float


@dataclass(frozen=True)
class _Layer:
    input_norm: _Norm
    q: _Linear
    k: _Linear
    v: _Linear
    q_norm: _Norm | None  # Qwen3 normalises each head's query and key
    k_norm: _Norm | None
    o: _Linear
    post_norm: _Norm
    gate: _Linear | None  # a dense MLP's; None where ``experts`` runs
    up: _Linear | None
    down: _Linear | None
    act: object
    experts: torch.nn.Module | None  # an MoE layer's block (router and experts), HF's module
    qkv: Packed | None  # q, k, v (gate, up) as one packed matmul, where it applies
    gate_up: Packed | None


class BodyOutput(NamedTuple):
    last_hidden_state: torch.Tensor


def _linear(module, packed: bool = True) -> _Linear:
    """``packed=False`` for a part of a fused matrix (q, k, v; gate, up): it packs with the others."""
    return _Linear(module.weight, module.bias, pack((module.weight, module.bias)) if packed else None)


def _norm(module) -> _Norm:
    return _Norm(module.weight, module.variance_epsilon)


def linear(x: torch.Tensor, layer: _Linear) -> torch.Tensor:
    """``F.linear`` of ``x`` ``[T, in]``, bit for bit (packed or ``mv`` where they apply)."""
    if layer.packed is not None and layer.packed.serves(x.shape[0]):
        return layer.packed(x)
    return plain_linear(x, layer.weight, layer.bias)


def rms_norm(x: torch.Tensor, norm: _Norm) -> torch.Tensor:
    """HF's ``LlamaRMSNorm``, operation for operation."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps)
    return norm.weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


def lean_body(model) -> tuple["LeanBody | None", str]:
    """``(LeanBody, "")`` for a supported model, else ``(None, why not)``."""
    body = model.base_model
    config = model.config
    name = type(body).__name__
    if name not in FAMILIES:
        return None, f"{name} is not one of {', '.join(FAMILIES)}"
    if sliding_window_layers(config):
        return None, "sliding-window layers"
    if getattr(config, "pretraining_tp", 1) != 1:
        return None, "pretraining_tp > 1"
    return LeanBody(body), ""


class LeanBody:
    """The HF body's call in :meth:`.ModelRunner.forward`; returns ``last_hidden_state``."""

    def __init__(self, body):
        self.embed, self.rotary, self.final_norm = body.embed_tokens, body.rotary_emb, _norm(body.norm)
        first = body.layers[0].self_attn
        self.heads, self.kv_heads = body.config.num_attention_heads, body.config.num_key_value_heads
        self.head_dim, self.scaling = first.head_dim, first.scaling
        self.layers = [self._layer(layer) for layer in body.layers[: body.config.num_hidden_layers]]

    @staticmethod
    def _layer(layer) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        if hasattr(mlp, "gate_proj"):  # a dense MLP (Qwen3-MoE's mlp_only_layers too)
            gate, up = _linear(mlp.gate_proj, packed=False), _linear(mlp.up_proj, packed=False)
            ffn = dict(gate=gate, up=up, down=_linear(mlp.down_proj), act=mlp.act_fn, experts=None,
                       gate_up=pack(gate[:2], up[:2]))
        else:  # a sparse MoE block: router and experts stay HF's module
            ffn = dict(gate=None, up=None, down=None, act=None, experts=mlp, gate_up=None)
        q, k, v = (_linear(proj, packed=False) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        return _Layer(
            input_norm=_norm(layer.input_layernorm), q=q, k=k, v=v,
            q_norm=None if q_norm is None else _norm(q_norm), k_norm=None if k_norm is None else _norm(k_norm),
            o=_linear(attn.o_proj), post_norm=_norm(layer.post_attention_layernorm),
            qkv=pack(q[:2], k[:2], v[:2]), **ffn,
        )

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: RowKVCache,
                wedlm_packing: Packing, attention_mask=None, use_cache: bool = True) -> BodyOutput:
        """One packed step; ``attention_mask`` must be None."""
        if attention_mask is not None or input_ids.shape[0] != 1:
            raise ValueError("LeanBody runs packed steps only: input [1, T], no attention mask")
        x = self.embed(input_ids)
        cos, sin = self.rotary(x, position_ids=position_ids)
        cos, sin = cos[:, None], sin[:, None]  # [1, 1, T, dim], over the heads
        x = x[0]
        tokens = x.shape[0]
        for index, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm)
            if layer.qkv is not None and layer.qkv.serves(tokens):
                q, k, v = layer.qkv.split(h)
            else:
                q, k, v = linear(h, layer.q), linear(h, layer.k), linear(h, layer.v)
            q = q.view(tokens, self.heads, self.head_dim)
            k = k.view(tokens, self.kv_heads, self.head_dim)
            v = v.view(tokens, self.kv_heads, self.head_dim)
            if layer.q_norm is not None:
                q, k = rms_norm(q, layer.q_norm), rms_norm(k, layer.k_norm)
            q = _rotate(q.transpose(0, 1)[None], cos, sin)
            k = _rotate(k.transpose(0, 1)[None], cos, sin)
            keys, values = cache.layers[index].update(k, v.transpose(0, 1)[None])
            out, _ = packed_sdpa(None, q, keys, values, None, wedlm_packing=wedlm_packing, scaling=self.scaling)
            x = x + linear(out.reshape(tokens, -1), layer.o)
            h = rms_norm(x, layer.post_norm)
            if layer.experts is not None:  # routed per token; [1, T, hidden] as HF's layer passes it
                x = x + layer.experts(h[None])[0]
            elif layer.gate_up is not None and layer.gate_up.serves(tokens):
                gate, up = layer.gate_up.split(h)
                x = x + linear(layer.act(gate) * up, layer.down)
            else:
                x = x + linear(layer.act(linear(h, layer.gate)) * linear(h, layer.up), layer.down)
        return BodyOutput(rms_norm(x, self.final_norm)[None])

    __call__ = forward


def output_layer(head: torch.nn.Linear) -> _Linear:
    """The output layer's weights, packed where they may be (:func:`project` runs it)."""
    return _linear(head)


def project(head: _Linear, hidden: torch.Tensor) -> torch.Tensor:
    """The output layer over ``hidden`` ``[n, hidden]``."""
    return linear(hidden, head)
