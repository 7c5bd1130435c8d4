"""Mixture-of-experts layers: Megatron-Core's ``MoELayer`` in place of the MLP (docs/method.md, "MoE").

:class:`MoESettings` holds how a run trains the routers (not the architecture, which is
:class:`.hf_config.ModelArgs`); :func:`moe_config_fields` turns both into ``TransformerConfig``
fields. Routing follows Qwen3-MoE: softmax over all experts then top-k, or, with
``norm_topk_prob``, softmax over the top-k logits (the same weights, renormalised).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # a light module (no torch at import): the config schema reads its table
    from .hf_config import ModelArgs

__all__ = [
    "LOAD_BALANCING_TYPES", "MoESettings", "ROUTER_LOSS_NAMES", "keep_experts_apart", "moe_config_fields", "moe_mlp_spec",
    "take_router_losses",
]

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")


@dataclass(frozen=True)
class MoESettings:
    """Router losses, capacity and expert kernels of a MoE run; ignored by dense models."""

    aux_loss_coeff: float = 1e-3  # load-balancing loss weight (Qwen3-MoE's router_aux_loss_coef)
    z_loss_coeff: float | None = None  # router z-loss weight; None: no z-loss
    load_balancing: str = "aux_loss"  # a LOAD_BALANCING_TYPES name (Megatron's moe_router_load_balancing_type)
    capacity_factor: float | None = None  # tokens per expert over the even share; None: dropless
    grouped_gemm: bool = False  # one grouped GEMM for the local experts (GPU, Transformer Engine)

    def __post_init__(self) -> None:
        if self.load_balancing not in LOAD_BALANCING_TYPES:
            raise ValueError(f"load_balancing must be one of {LOAD_BALANCING_TYPES}, got {self.load_balancing!r}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be > 0 or None (dropless), got {self.capacity_factor}")


def moe_config_fields(args: ModelArgs, settings: MoESettings) -> dict[str, Any]:
    """The ``TransformerConfig`` fields of ``args``' experts trained as ``settings`` say; {} if dense.

    The alltoall dispatcher is the one that runs over gloo (CPU) as well as NCCL; fused permute
    and router kernels are CUDA-only, so they stay off and the math is the same on both.
    """
    if not args.is_moe:
        return {}
    from megatron.core import parallel_state as ps

    fields: dict[str, Any] = dict(
        num_moe_experts=args.num_experts,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_router_topk=args.moe_topk,
        moe_router_pre_softmax=not args.moe_norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type=settings.load_balancing,
        moe_aux_loss_coeff=settings.aux_loss_coeff if settings.load_balancing != "none" else 0.0,
        moe_z_loss_coeff=settings.z_loss_coeff,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=settings.grouped_gemm,
        moe_permute_fusion=False,
        moe_router_fusion=False,
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
    )
    if settings.capacity_factor is not None:
        fields.update(moe_expert_capacity_factor=settings.capacity_factor, moe_pad_expert_input_to_capacity=False,
                      moe_token_drop_policy="probs")
    return fields


def moe_mlp_spec(num_experts: int, grouped_gemm: bool):
    """The ``mlp`` submodule of a MoE layer: router, alltoall dispatcher and experts (a loop of
    local MLPs, or Transformer Engine's grouped GEMM); no shared experts (Qwen3-MoE has none)."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    return get_moe_module_spec(use_te=grouped_gemm, num_experts=num_experts, moe_grouped_gemm=grouped_gemm)


def keep_experts_apart(model) -> None:
    """Mark every expert weight expert-parallel (``allreduce=False``) even at EP=1.

    Megatron marks them only when EP > 1, and the mark decides whether experts get their own
    gradient buffers and optimizer (a ChainedOptimizer of two) or join the dense ones. Marked at
    every EP, the optimizer state has one structure, so a checkpoint resumes at another EP; at
    EP=1 the expert data-parallel group is the data-parallel group, so the gradients are the same.
    """
    for name, param in model.named_parameters():
        if ".mlp.experts." in name:
            param.allreduce = False


#: Megatron's tracker names -> the names a run logs them under (next to mlm_loss and ar_loss).
ROUTER_LOSS_NAMES = {"load_balancing_loss": "moe_aux_loss", "seq_load_balancing_loss": "moe_aux_loss",
                     "z_loss": "moe_z_loss"}


def take_router_losses(num_microbatches: int) -> dict[str, float]:
    """The step's router losses (before their coefficients), averaged over layers and micro-batches
    as one process would see them, then the tracker cleared; {} for a dense model. Collective:
    every rank calls it after the step.

    Megatron's own reduction averages with ``ReduceOp.AVG``, which gloo lacks, so it is done here
    with sums: a value that is one rank's part of a whole (``reduce_group``, TP x CP for the
    balancing loss) is summed over that group; then every layer's value is averaged over the ranks
    that hold the layer (the world over PP; other stages hold zeros for it).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe import moe_utils

    tracker = _tracker_entries(moe_utils)
    out: dict[str, float] = {}
    for name in sorted(tracker):
        values = tracker[name]["values"].detach().clone().float()
        if dist.is_initialized():
            if tracker[name]["reduce_group"] is not None:
                dist.all_reduce(values, group=tracker[name]["reduce_group"])
            dist.all_reduce(values)
            values /= dist.get_world_size() // ps.get_pipeline_model_parallel_world_size()
        out[ROUTER_LOSS_NAMES.get(name, "moe_" + name)] = float(values.mean()) / num_microbatches
    moe_utils.clear_aux_losses_tracker()
    return out


def _tracker_entries(moe_utils) -> dict[str, dict]:
    """Megatron's router-loss tracker as ``{name: {values, reduce_group}}`` (0.16 and 0.19)."""
    if hasattr(moe_utils, "get_moe_metrics_tracker"):  # 0.19
        metrics = moe_utils.get_moe_metrics_tracker().metrics
        return {name: {"values": e.values, "reduce_group": e.reduce_group} for name, e in metrics.items()}
    return {name: {"values": e["values"], "reduce_group": e.get("reduce_group")}
            for name, e in moe_utils.get_moe_layer_wise_logging_tracker().items()}
