"""The WeDLM GPT model: Megatron's ``GPTModel`` with logical-position RoPE and the WeDLM mask.

A thin subclass, so everything that makes Megatron scale stays Megatron's. It changes three
things: RoPE from ``position_ids`` on every pipeline stage (:mod:`.rope`); ``attention_mask``
carries the packed WeDLM metadata to the core attention (:mod:`.attention`); given labels,
only labelled slots go through the output layer (same per-slot loss). Parameter names equal
``GPTModel``'s. One path builds it (:func:`build_model_chunks`), so what is verified trains.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer import TransformerConfig

from megatron_wedlm.data.attention_rule import AttentionMetadata
from megatron_wedlm.data.packed_metadata import causal_packed_metadata, pack_attention_metadata
from megatron_wedlm.runtime.parallel import batched_p2p_supported

from .attention_backends import get_attention_backend
from .hf_config import ModelArgs
from .layer_spec import get_wedlm_block_spec
from .moe import MoESettings, keep_experts_apart, moe_config_fields
from .recompute import RECOMPUTE_MODES
from .rope import LogicalRotaryEmbedding

__all__ = [
    "BuildSettings", "ModelChunks", "RECOMPUTE_MODES", "WeDLMGPTModel", "build_model_chunks", "build_wedlm_model",
    "wedlm_transformer_config",
]


@dataclass
class BuildSettings:
    """How a run builds the model a :class:`ModelArgs` describes: everything but architecture
    (precision, device, layout features, attention kernel).
    """

    params_dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # picks init place and fusions
    sequence_parallel: bool = False
    recompute: str = "none"  # a RECOMPUTE_MODES name
    recompute_num_layers: int = 1  # layers per recomputed chunk (recompute='full')
    init_method_std: float = 0.02
    initialize: bool = True  # False: allocate only (conversion overwrites every tensor)
    attention_backend: str = "dense"  # a concrete backend name ('auto' is resolved before)
    backend_options: dict[str, Any] = field(default_factory=dict)  # the backend's spec params by name
    moe: MoESettings = field(default_factory=MoESettings)  # router losses and expert kernels (MoE models)

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {self.recompute!r}")
        self.device = torch.device(self.device)
        get_attention_backend(self.attention_backend).core_attention_spec(**self.backend_options)  # names checked now


class WeDLMGPTModel(GPTModel):
    """``GPTModel`` whose RoPE follows ``position_ids`` and whose attention applies the WeDLM mask.

    ``forward(input_ids, position_ids, attention_mask=None, labels=None, *, attention_metadata=None)``:
    ``[B, S]`` rows with logical ``position_ids`` (needed on every stage); ``attention_mask`` as
    :mod:`.attention` takes it, or an ``AttentionMetadata``; ``padding_mask`` (True: padding) keeps
    padding out of MoE routing statistics. With ``labels`` (-100: none) the last
    stage returns per-slot cross entropy ``[B, S]``, without them logits ``[B, S, V / TP]``; other
    stages return hidden states. ``all_slot_logits`` takes stock ``GPTModel``'s loss path.
    """

    all_slot_logits: bool = False

    def __init__(
        self,
        config,
        transformer_layer_spec,
        args: ModelArgs,
        pre_process: bool = True,
        post_process: bool = True,
        vp_stage: int | None = None,
    ) -> None:
        _check_config(config)
        super().__init__(
            config=config,
            transformer_layer_spec=transformer_layer_spec,
            vocab_size=args.padded_vocab_size,
            max_sequence_length=args.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=args.tie_word_embeddings,
            position_embedding_type="none",
            vp_stage=vp_stage,
        )
        self.model_args = args
        self.logical_rotary_emb = LogicalRotaryEmbedding(
            kv_channels=config.kv_channels, rotary_base=args.rope_theta, rotary_interleaved=config.rotary_interleaved
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
        padding_mask = kwargs.get("padding_mask")
        if padding_mask is not None and not self.pre_process and self.config.sequence_parallel:
            # GPTModel splits the MoE padding mask over SP ranks on the first stage only.
            kwargs["padding_mask"] = scatter_to_sequence_parallel_region(padding_mask.transpose(0, 1).contiguous()) \
                .transpose(0, 1).contiguous()
        return super().forward(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            decoder_input=decoder_input,
            labels=labels,
            runtime_gather_output=runtime_gather_output,
            **kwargs,
        )

    def _postprocess(self, hidden_states: Tensor, input_ids, position_ids, labels: Tensor | None, *args, **kwargs):
        if labels is None or not self.post_process:
            return super()._postprocess(hidden_states, input_ids, position_ids, labels, *args, **kwargs)
        ignore = labels < 0
        labels = labels.masked_fill(ignore, 0)  # vocab-parallel CE has no ignore index
        if self.all_slot_logits:
            loss = super()._postprocess(hidden_states, input_ids, position_ids, labels, *args, **kwargs)
        else:
            loss = self._labelled_slot_loss(hidden_states, labels, ignore)
        return loss.masked_fill(ignore, 0.0)

    def _labelled_slot_loss(self, hidden_states: Tensor, labels: Tensor, ignore: Tensor) -> Tensor:
        """Per-slot cross entropy ``[B, S]`` from the labelled slots' logits alone; 0 elsewhere.

        Under SP the hidden states are gathered first, so every TP rank picks the same slots; every
        rank calls the output layer, even with none picked, to keep the collectives matched.
        """
        layer = self.output_layer
        sequence_parallel = layer.sequence_parallel
        if sequence_parallel:
            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False, group=layer.tp_group
            )
        seq, batch, hidden = hidden_states.shape
        keep = (~ignore).transpose(0, 1).reshape(-1).nonzero().squeeze(1)  # [S*B] order, as the hidden states
        picked = hidden_states.reshape(seq * batch, hidden).index_select(0, keep).unsqueeze(1)
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        layer.sequence_parallel = False
        try:
            logits, _ = layer(picked, weight=weight, runtime_gather_output=False)
        finally:
            layer.sequence_parallel = sequence_parallel
        picked_labels = labels.transpose(0, 1).reshape(-1).index_select(0, keep).unsqueeze(0)
        loss = self.compute_language_model_loss(picked_labels, logits).reshape(-1)  # [1, N] -> [N]
        full = loss.new_zeros(seq * batch).index_copy(0, keep, loss)
        return full.view(seq, batch).transpose(0, 1)


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


def wedlm_transformer_config(args: ModelArgs, settings: BuildSettings):
    """The one ``TransformerConfig`` of the model ``args`` describes, built as ``settings`` say.

    RMSNorm, SwiGLU, no linear biases or dropout; unfused RoPE (per-slot positions); bias-dropout
    fusion on GPU only. Layout sizes come from Megatron's parallel state.
    """
    dtype = settings.params_dtype
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=args.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=args.add_qkv_bias,
        qk_layernorm=args.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        context_parallel_size=ps.get_context_parallel_world_size(),
        virtual_pipeline_model_parallel_size=ps.get_virtual_pipeline_model_parallel_world_size(),
        sequence_parallel=settings.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        init_method_std=settings.init_method_std,
        perform_initialization=settings.initialize,
        use_cpu_initialization=settings.device.type == "cpu",
        batch_p2p_comm=batched_p2p_supported(),
        bias_dropout_fusion=settings.device.type == "cuda",
        bias_activation_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        **_recompute_fields(settings),
        **moe_config_fields(args, settings.moe),
    )


def _recompute_fields(settings: BuildSettings) -> dict[str, Any]:
    if settings.recompute == "full":
        return dict(recompute_granularity="full", recompute_method="uniform",
                    recompute_num_layers=settings.recompute_num_layers)
    if settings.recompute == "selective":
        return dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    return {}


def build_wedlm_model(
    config,
    args: ModelArgs,
    attention_backend: str = "dense",
    backend_options: dict[str, Any] | None = None,
    *,
    vp_stage: int | None = None,
) -> WeDLMGPTModel:
    """One WeDLM model chunk of this rank (``vp_stage``: its virtual-pipeline chunk); needs
    Megatron's parallel state. Most callers want :func:`build_model_chunks`.
    """
    tp = ps.get_tensor_model_parallel_world_size()
    if args.padded_vocab_size % tp:
        raise ValueError(
            f"the padded vocabulary ({args.padded_vocab_size} rows) does not split over tensor-parallel size {tp}; "
            f"pad it to a multiple of {tp} (model.make_vocab_size_divisible_by, or convert the checkpoint with --tp {tp})"
        )
    spec = get_wedlm_block_spec(config, attention_backend, vp_stage=vp_stage, **(backend_options or {}))
    pre_process = ps.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    post_process = ps.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    model = WeDLMGPTModel(config, spec, args, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
    if args.is_moe:
        keep_experts_apart(model)
    return model


class ModelChunks(list):
    """This rank's model chunks (one per virtual pipeline stage); checkpoints treat them as one
    model, so checkpoints of any layout load into any other.
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


def build_model_chunks(args: ModelArgs, settings: BuildSettings) -> ModelChunks:
    """This rank's WeDLM model for the current Megatron layout, on ``settings.device``: the one
    build of training, ``tools/verify_parallel.py``, conversion and the benchmarks.
    """
    config = wedlm_transformer_config(args, settings)
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    stages: list[int | None] = [None] if vpp is None else list(range(vpp))
    return ModelChunks(
        build_wedlm_model(config, args, settings.attention_backend, settings.backend_options, vp_stage=stage)
        .to(settings.device)
        for stage in stages
    )
