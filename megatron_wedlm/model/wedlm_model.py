"""The WeDLM GPT model: Megatron's ``GPTModel`` with logical-position RoPE and the WeDLM mask.

Why a thin subclass: everything that makes Megatron scale (vocab-parallel embedding and output
layer, TP/SP/PP plumbing, ``sharded_state_dict``, DDP, distributed optimizer, recompute) stays
Megatron's. The subclass changes two things:

1. RoPE: the model is built with ``position_embedding_type='none'`` (no learned positions, no
   0..S-1 table) and ``_preprocess`` supplies per-slot frequencies from ``position_ids``
   (:class:`.rope.LogicalRotaryEmbedding`). ``_preprocess`` runs on every pipeline stage,
   so every stage needs ``position_ids``.
2. ``attention_mask`` carries the packed WeDLM metadata ``[B, 3, S]`` to the layers' core
   attention (see :mod:`.attention`); ``forward`` also accepts an ``AttentionMetadata``.
   Without either, the model is a plain causal LM over the row.

Parameter names equal those of ``GPTModel`` + ``get_gpt_layer_local_spec`` (see
:mod:`.layer_spec`), so checkpoints convert 1:1.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core.models.gpt import GPTModel

from megatron_wedlm.data.attention_rule import AttentionMetadata

from .attention import ATTENTION_BACKENDS, causal_packed_metadata, pack_attention_metadata
from .layer_spec import get_wedlm_block_spec
from .rope import LogicalRotaryEmbedding

__all__ = ["WeDLMGPTModel", "WeDLMModelArgs", "build_wedlm_model", "wedlm_transformer_config"]


@dataclass
class WeDLMModelArgs:
    """Model arguments that are not part of Megatron's ``TransformerConfig``."""

    vocab_size: int
    max_sequence_length: int
    mask_token_id: int
    attention_backend: str = "dense"
    share_embeddings_and_output_weights: bool = False
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    seq_len_interpolation_factor: float | None = None
    parallel_output: bool = True
    flex_tile_size: int = 128
    flex_compile: bool | None = None
    dense_tile_size: int = 64
    extra: dict[str, Any] = field(default_factory=dict)  # free-form provenance (e.g. HF model_type)

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {self.vocab_size}")
        if isinstance(self.mask_token_id, bool) or int(self.mask_token_id) != self.mask_token_id:
            raise ValueError(f"mask_token_id must be an integer token id, got {self.mask_token_id!r}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} has no embedding row: the vocabulary has "
                f"{self.vocab_size} entries. Add the mask token to the tokenizer and resize the "
                "embeddings (or pad vocab_size) before building the model"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class WeDLMGPTModel(GPTModel):
    """``GPTModel`` whose RoPE follows ``position_ids`` and whose attention applies the WeDLM mask.

    ``forward(input_ids, position_ids, attention_mask=None, labels=None, *, attention_metadata=None)``:

    * ``input_ids``, ``position_ids``: ``[B, S]`` physical dual-stream rows (``S = 2L`` per
      document); ``position_ids`` are logical and are needed on *every* pipeline stage.
    * ``attention_mask``: packed metadata ``[B, 3, S]`` (:func:`.attention.pack_attention_metadata`),
      or a Megatron bool mask ``[B, 1, S, S]`` (True = masked out; dense/TE backends), or None
      for plain causal attention. An ``AttentionMetadata`` (positionally or as
      ``attention_metadata=``) is the convenient alternative and is packed here.
    * ``labels``: ``[B, S]`` token ids, ``-100`` = no loss. Given labels, the last stage returns
      the per-slot cross entropy ``[B, S]`` (vocab-parallel, zero where ignored); without them
      it returns logits ``[B, S, V / TP]`` (``[B, S, V]`` with ``runtime_gather_output=True``).
      Other stages return hidden states for the next one.
    """

    def __init__(
        self,
        config,
        transformer_layer_spec,
        args: WeDLMModelArgs,
        pre_process: bool = True,
        post_process: bool = True,
        vp_stage: int | None = None,
    ) -> None:
        _check_config(config)
        super().__init__(
            config=config,
            transformer_layer_spec=transformer_layer_spec,
            vocab_size=args.vocab_size,
            max_sequence_length=args.max_sequence_length,
            pre_process=pre_process,
            post_process=post_process,
            parallel_output=args.parallel_output,
            share_embeddings_and_output_weights=args.share_embeddings_and_output_weights,
            position_embedding_type="none",
            vp_stage=vp_stage,
        )
        self.wedlm_args = args
        self.mask_token_id = int(args.mask_token_id)
        self.attention_backend = args.attention_backend
        self.logical_rotary_emb = LogicalRotaryEmbedding(
            kv_channels=config.kv_channels,
            rotary_percent=args.rotary_percent,
            rotary_base=args.rotary_base,
            rotary_interleaved=config.rotary_interleaved,
            seq_len_interpolation_factor=args.seq_len_interpolation_factor,
            rope_scaling=args.rope_scaling,
            rope_scaling_factor=args.rope_scaling_factor,
        )

    def _preprocess(self, input_ids, position_ids, decoder_input=None, inference_context=None,
                    packed_seq_params=None, padding_mask=None):
        out = list(super()._preprocess(
            input_ids=input_ids,
            position_ids=position_ids,
            decoder_input=decoder_input,
            inference_context=inference_context,
            packed_seq_params=packed_seq_params,
            padding_mask=padding_mask,
        ))
        out[1] = self.logical_rotary_emb(position_ids)  # rotary_pos_emb slot of the tuple
        return tuple(out)

    def forward(
        self,
        input_ids: Tensor | None,
        position_ids: Tensor,
        attention_mask: Tensor | None = None,
        decoder_input: Tensor | None = None,
        labels: Tensor | None = None,
        *,
        attention_metadata: AttentionMetadata | None = None,
        runtime_gather_output: bool | None = None,
        **kwargs: Any,
    ) -> Tensor:
        if kwargs.get("inference_context") is not None or kwargs.get("inference_params") is not None:
            raise ValueError(
                "WeDLMGPTModel is a training model; decode with megatron_wedlm.decoding on an "
                "exported checkpoint (KV-cache inference contexts are not wired to logical RoPE)"
            )
        if kwargs.get("packed_seq_params") is not None:
            raise ValueError("WeDLMGPTModel does not take packed_seq_params; pack documents into rows instead")
        if position_ids is None:
            raise ValueError("position_ids are required on every pipeline stage (logical RoPE positions)")
        if isinstance(attention_mask, AttentionMetadata):
            if attention_metadata is not None:
                raise ValueError("give the AttentionMetadata once (attention_mask or attention_metadata)")
            attention_metadata, attention_mask = attention_mask, None
        if attention_metadata is not None:
            if attention_mask is not None:
                raise ValueError("give attention_mask or attention_metadata, not both")
            attention_mask = pack_attention_metadata(attention_metadata).to(position_ids.device)
        if attention_mask is None:
            attention_mask = causal_packed_metadata(position_ids.shape[0], position_ids.shape[1], position_ids.device)
        if input_ids is not None and self.pre_process and input_ids.shape != position_ids.shape:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and position_ids {tuple(position_ids.shape)} differ")
        ignore = None
        if labels is not None:
            ignore = labels < 0
            labels = labels.masked_fill(ignore, 0)  # vocab-parallel CE has no ignore index
        out = super().forward(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            decoder_input=decoder_input,
            labels=labels,
            runtime_gather_output=runtime_gather_output,
            **kwargs,
        )
        if labels is not None and self.post_process:
            out = out.masked_fill(ignore, 0.0)
        return out


def _check_config(config) -> None:
    if config.apply_rope_fusion:
        raise ValueError(
            "apply_rope_fusion=True is not supported: the fused RoPE kernel takes one position table "
            "for the batch, WeDLM needs per-slot logical positions. Set apply_rope_fusion=False"
        )
    if config.multi_latent_attention:
        raise ValueError("multi_latent_attention is not supported by the WeDLM model")
    if getattr(config, "mtp_num_layers", None):
        raise ValueError("multi-token prediction layers are not supported by the WeDLM model")
    if config.num_moe_experts:
        raise ValueError("MoE layers are not wired into the WeDLM layer spec yet (num_moe_experts must be None)")


def build_wedlm_model(
    config,
    args: WeDLMModelArgs | None = None,
    *,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    vp_stage: int | None = None,
    **arg_fields: Any,
) -> WeDLMGPTModel:
    """Build this rank's WeDLM model chunk.

    ``args`` or its fields as keywords (``vocab_size``, ``max_sequence_length``,
    ``mask_token_id``, ``attention_backend``, ``share_embeddings_and_output_weights``,
    ``rotary_base``, ...). ``pre_process`` / ``post_process`` default to this rank's pipeline
    position. Megatron's parallel state must be initialised.
    """
    from megatron.core import parallel_state as ps

    if args is None:
        args = WeDLMModelArgs(**arg_fields)
    elif arg_fields:
        raise ValueError("give either args or keyword fields, not both")
    if pre_process is None:
        pre_process = ps.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    if post_process is None:
        post_process = ps.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    tp = ps.get_tensor_model_parallel_world_size()
    if args.vocab_size % tp:
        raise ValueError(
            f"vocab_size {args.vocab_size} is not divisible by the tensor-parallel size {tp}; pad the "
            "vocabulary (e.g. to a multiple of 128 x TP) when converting the checkpoint"
        )
    spec = get_wedlm_block_spec(
        config, args.attention_backend, vp_stage=vp_stage,
        flex_tile_size=args.flex_tile_size, flex_compile=args.flex_compile, dense_tile_size=args.dense_tile_size,
    )
    return WeDLMGPTModel(config, spec, args, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)


def wedlm_transformer_config(
    *,
    num_layers: int,
    hidden_size: int,
    num_attention_heads: int,
    ffn_hidden_size: int,
    num_query_groups: int | None = None,
    kv_channels: int | None = None,
    qk_layernorm: bool = False,
    add_qkv_bias: bool = False,
    normalization: str = "RMSNorm",
    layernorm_epsilon: float = 1e-6,
    params_dtype: torch.dtype = torch.float32,
    sequence_parallel: bool = False,
    **overrides: Any,
):
    """A ``TransformerConfig`` for a Qwen2/Qwen3/Llama-shaped WeDLM model on this rank's layout.

    Fixed choices: SwiGLU MLP without linear biases, no dropout, unfused RoPE (required for
    logical positions); CPU-safe fusions off when there is no GPU. TP/PP/VPP/CP sizes come from
    Megatron's parallel state. ``overrides`` go straight to ``TransformerConfig`` (e.g.
    ``recompute_granularity='full'``, ``bf16=True``).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig

    from megatron_wedlm.runtime.parallel import batched_p2p_supported

    on_gpu = torch.cuda.is_available()
    values: dict[str, Any] = dict(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        num_query_groups=num_query_groups or num_attention_heads,
        ffn_hidden_size=ffn_hidden_size,
        kv_channels=kv_channels,
        qk_layernorm=qk_layernorm,
        add_qkv_bias=add_qkv_bias,
        normalization=normalization,
        layernorm_epsilon=layernorm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        context_parallel_size=ps.get_context_parallel_world_size(),
        virtual_pipeline_model_parallel_size=ps.get_virtual_pipeline_model_parallel_world_size(),
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        use_cpu_initialization=not on_gpu,
        apply_rope_fusion=False,
        bias_dropout_fusion=on_gpu,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        masked_softmax_fusion=False,
        batch_p2p_comm=batched_p2p_supported(),
    )
    values.update(overrides)
    return TransformerConfig(**values)
