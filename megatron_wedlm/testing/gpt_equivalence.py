"""Does a parallel layout compute what one process computes? Worker functions for Megatron's GPT.

Under :func:`~megatron_wedlm.runtime.multiprocess.run_distributed`: ``save_reference`` (1 rank)
saves seeded TP=PP=1 weights and returns loss and gradients; ``run_layout`` (TP x PP ranks) loads
them, steps the same batch through training's schedule and saves the gradients as a checkpoint;
``gather_checkpoint`` (1 rank) reassembles it at TP=PP=1. The model-agnostic pieces are the base of
:mod:`.wedlm_equivalence`; :func:`build_gpt` is also the conversion and model tests' reference.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Callable

import torch

from megatron_wedlm.model.hf_config import ModelArgs
from megatron_wedlm.runtime.parallel import ParallelConfig, initialize_parallel_state
from megatron_wedlm.training.megatron_engine import run_schedule

if TYPE_CHECKING:
    from megatron_wedlm.model.wedlm_model import BuildSettings


@dataclass
class TinyShape:
    """The transformer dimensions every equivalence model shares: small, but with GQA and a
    TP=2 split of heads, groups and FFN that leaves more than one of each per rank."""

    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int = 2
    ffn_hidden_size: int = 128
    vocab_size: int = 128

    def shape_fields(self) -> dict[str, Any]:
        """The ``ModelArgs`` fields this shape fixes (fp32 weights, an unpadded vocabulary)."""
        names = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size")
        return dict(
            {name: getattr(self, name) for name in names},
            head_dim=self.hidden_size // self.num_attention_heads,
            padded_vocab_size=self.vocab_size,
            rms_norm_eps=1e-6,
            dtype="float32",
        )


@dataclass
class TinyGPTSpec(TinyShape):
    """A small Qwen/Llama-shaped GPT: RMSNorm, SwiGLU, RoPE, GQA, untied output layer."""

    seq_length: int = 32
    micro_batch_size: int = 2
    num_microbatches: int = 2
    seed: int = 1234

    def model_args(self) -> ModelArgs:
        return ModelArgs(
            **self.shape_fields(), architecture="llama", max_position_embeddings=self.seq_length, rope_theta=10000.0,
            qk_layernorm=False, add_qkv_bias=False, tie_word_embeddings=False,
        )


def build_gpt(args: ModelArgs, settings: BuildSettings | None = None):
    """Megatron-Core's own ``GPTModel`` (local spec, causal mask, its MoE layer for a MoE model) of
    ``args`` for this rank's stage, on the WeDLM model's config: the reference that, with the same
    weights (and names), the WeDLM model must match on causal rows."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_wedlm.model.wedlm_model import BuildSettings, wedlm_transformer_config  # imports Megatron-Core

    settings = settings or BuildSettings()
    return GPTModel(
        config=wedlm_transformer_config(args, settings),
        transformer_layer_spec=get_gpt_layer_local_spec(
            num_experts=args.num_experts, qk_layernorm=args.qk_layernorm, normalization="RMSNorm"
        ),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=args.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=args.rope_theta,
    ).to(settings.device)


def make_batches(spec: TinyGPTSpec) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(spec.seed + 1)
    batches = []
    for _ in range(spec.num_microbatches):
        tokens = torch.randint(0, spec.vocab_size, (spec.micro_batch_size, spec.seq_length + 1), generator=g)
        loss_mask = (torch.rand(spec.micro_batch_size, spec.seq_length, generator=g) > 0.2).float()
        batches.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": loss_mask})
    return batches


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    # GPTModel returns per-token losses (vocab-parallel cross entropy) when given labels.
    loss = (output_tensor.float() * loss_mask).sum() / loss_mask.sum()
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    positions = torch.arange(batch["tokens"].shape[1]).unsqueeze(0).expand_as(batch["tokens"])
    output = model(
        input_ids=batch["tokens"],
        position_ids=positions,
        attention_mask=None,
        labels=batch["labels"],
    )
    return output, partial(_loss_func, batch["loss_mask"])


def forward_backward(model, spec: TinyGPTSpec, forward_step: Callable = _forward_step) -> float | None:
    """One schedule step of the GPT batches; the mean loss on the last stage, else None."""
    chunks = model if isinstance(model, list) else [model]
    losses = run_schedule(chunks, forward_step, make_batches(spec), spec.seq_length, spec.micro_batch_size)
    if losses is None:
        return None
    return float(torch.stack([d["lm loss"] for d in losses]).mean())


def grads_into_params(model, use_main_grad: bool = False) -> None:
    """Overwrite every parameter with its gradient (``param.main_grad``, DDP's reduced one, with
    ``use_main_grad``), so a checkpoint of the model holds the grads."""
    for param in model.parameters():
        grad = getattr(param, "main_grad", None) if use_main_grad else param.grad
        param.data.copy_(grad if grad is not None else torch.zeros_like(param))


def save_sharded(model, directory: str) -> None:
    """Save ``model``'s sharded state (a module or ``ModelChunks``) as ``torch_dist`` (all ranks call)."""
    from megatron.core import dist_checkpointing

    os.makedirs(directory, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), directory)


def load_sharded(model, directory: str) -> None:
    """Load a ``torch_dist`` checkpoint into ``model`` (a module or ``ModelChunks``) in this layout."""
    from megatron.core import dist_checkpointing

    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), directory))


def init_layout(tp: int, pp: int, seed: int, sequence_parallel: bool = False, cp: int = 1, vpp: int | None = None,
                ep: int = 1, etp: int | None = None):
    """(Re-)create Megatron's groups for TP x PP x CP on CPU (``vpp`` model chunks per pipeline
    stage, experts over ``ep`` ranks with ``etp``-way TP each); DP is what the world size leaves."""
    return initialize_parallel_state(
        ParallelConfig(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            sequence_parallel=sequence_parallel,
            context_parallel_size=cp,
            virtual_pipeline_model_parallel_size=vpp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
        ),
        device="cpu",
        seed=seed,
    )


def gather_full(build: Callable[[], Any], seed: int, directory: str) -> dict[str, torch.Tensor]:
    """The full tensors by name of a ``torch_dist`` checkpoint, loaded into a TP=PP=1 model from
    ``build()`` (that layout re-created first), which reassembles the shards as Megatron does."""
    init_layout(1, 1, seed)
    model = build()
    load_sharded(model, directory)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def save_reference(spec_dict: dict, weights_dir: str) -> dict[str, Any]:
    spec = TinyGPTSpec(**spec_dict)
    init_layout(1, 1, spec.seed)
    model = build_gpt(spec.model_args())
    save_sharded(model, weights_dir)
    loss = forward_backward(model, spec)
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return {"loss": loss, "grads": grads}


def run_layout(
    spec_dict: dict, weights_dir: str, grads_dir: str, tp: int, pp: int, sequence_parallel: bool = False
) -> dict[str, Any]:
    from megatron_wedlm.model.wedlm_model import BuildSettings  # imports Megatron-Core

    spec = TinyGPTSpec(**spec_dict)
    init_layout(tp, pp, spec.seed, sequence_parallel)
    model = build_gpt(spec.model_args(), BuildSettings(sequence_parallel=sequence_parallel))
    load_sharded(model, weights_dir)
    loss = forward_backward(model, spec)
    grads_into_params(model)
    save_sharded(model, grads_dir)
    return {"loss": loss}


def gather_checkpoint(spec_dict: dict, ckpt_dir: str) -> dict[str, torch.Tensor]:
    spec = TinyGPTSpec(**spec_dict)
    return gather_full(lambda: build_gpt(spec.model_args()), spec.seed, ckpt_dir)


def spec_to_dict(spec: TinyGPTSpec) -> dict:
    return asdict(spec)
