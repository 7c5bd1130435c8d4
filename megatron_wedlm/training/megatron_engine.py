"""The Megatron-Core engine of :func:`megatron_wedlm.training.loop.run_training`: the parallel
layout, the WeDLM model chunks in Megatron DDP, Megatron's optimizer, the pipeline schedule with
the forward step below, and torch_dist checkpoints.

Megatron's schedule divides a returned loss by the number of micro-batches and multiplies it by
the CP size, and DDP averages gradients over DP x CP, so the forward step returns
``contribution * num_microbatches * dp`` (:func:`schedule_loss_scale`): the gradient applied is
that of the globally normalised step loss. Needs ``calculate_per_token_loss=False`` (checked).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from megatron_wedlm.config.schema import TrainConfig, validate_layout
from megatron_wedlm.data.dual_stream import DualStreamBatch
from megatron_wedlm.data.manifest import tokenizer_dir_of
from megatron_wedlm.model.context_parallel import shard_batch
from megatron_wedlm.model.hf_config import MODEL_ARGS_FILE
from megatron_wedlm.model.losses import LossNormalizer
from megatron_wedlm.model.moe import take_router_losses
from megatron_wedlm.runtime.hf_local import tokenizer_files_in
from megatron_wedlm.runtime.parallel import ParallelConfig, init_distributed, initialize_parallel_state

from .checkpointing import CheckpointManager
from .engine import RankRole, StepUpdate
from .model_setup import build_settings, load_init_weights, recorded_model, resolve_model_args
from .objective import Objective
from .optimization import build_optimizer, wrap_ddp
from .run_data import run_data_dir
from .throughput import ModelShape

__all__ = [
    "MegatronEngine", "MegatronPlan", "forward_backward_step", "forward_only_step", "megatron_forward_step",
    "run_model_on_shard", "run_schedule", "schedule_loss_scale",
]


def schedule_loss_scale(num_microbatches: int) -> int:
    """What a micro-batch's share of the step loss is multiplied by before Megatron sees it
    (``num_microbatches x DP``: the module docstring says why)."""
    from megatron.core import parallel_state as ps

    return num_microbatches * ps.get_data_parallel_world_size(with_context_parallel=False)


def run_model_on_shard(model, batch: DualStreamBatch, objective: Objective) -> tuple[DualStreamBatch, Tensor]:
    """Run ``model`` on this rank's part of ``batch`` (the whole batch without CP) against the
    objective's label row; returns the part (the loss reads its labels) and the model's output."""
    shard = shard_batch(batch)
    local = shard.batch
    moe = getattr(getattr(model, "config", None), "num_moe_experts", None)
    output = model(
        input_ids=local.input_ids,
        position_ids=local.position_ids,
        attention_mask=shard.attention_mask,
        labels=objective.labels(local),
        **({"padding_mask": local.is_padding} if moe else {}),
    )
    return local, output


def _schedule_loss(objective: Objective, batch: DualStreamBatch, normalizer: LossNormalizer, num_microbatches: int,
                   output_tensor: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    contribution, loss = objective.contribution(output_tensor, batch, normalizer)
    return contribution * schedule_loss_scale(num_microbatches), loss.report()


def megatron_forward_step(
    objective: Objective, normalizer: LossNormalizer, num_microbatches: int, device: torch.device | str | None = None
) -> Callable:
    """A ``forward_step_func`` for ``get_forward_backward_func()``: every stage reads whole
    micro-batches (positions, mask metadata), every CP rank keeps its slots."""

    def forward_step(data_iterator, model):
        config = getattr(model, "config", None)
        if config is not None and config.calculate_per_token_loss:
            raise ValueError("WeDLM losses are globally normalised; set calculate_per_token_loss=False")
        batch: DualStreamBatch = next(data_iterator)
        if device is not None:
            batch = batch.to(device)
        batch, output = run_model_on_shard(model, batch, objective)
        return output, partial(_schedule_loss, objective, batch, normalizer, num_microbatches)

    return forward_step


def run_schedule(chunks: Sequence, forward_step: Callable, batches: Sequence, seq_length: int,
                 micro_batch_size: int, forward_only: bool = False) -> list | None:
    """``batches`` through Megatron's schedule (its one caller here) over this rank's ``chunks``; the
    per-micro-batch reports on the last pipeline stage, None elsewhere."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    reports = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=[iter(batches) for _ in chunks] if len(chunks) > 1 else iter(batches),
        model=list(chunks),
        num_microbatches=len(batches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )
    return reports if ps.is_pipeline_last_stage() else None


def forward_backward_step(ddp_chunks: Sequence, batches: Sequence[DualStreamBatch], normalizer: LossNormalizer,
                          objective: Objective, seq_length: int, micro_batch_size: int,
                          device: torch.device | str | None = None) -> list[dict[str, Tensor]] | None:
    """Gradients of the globally normalised step loss in the DDP buffers (zeroed first), weights
    untouched; the loss reports on the last pipeline stage, None elsewhere."""
    for chunk in ddp_chunks:
        chunk.zero_grad_buffer()
    step = megatron_forward_step(objective, normalizer, len(batches), device)
    return run_schedule(ddp_chunks, step, batches, seq_length, micro_batch_size)


def forward_only_step(ddp_chunks: Sequence, batches: Sequence[DualStreamBatch], normalizer: LossNormalizer,
                      objective: Objective, seq_length: int, micro_batch_size: int,
                      device: torch.device | str | None = None) -> list[dict[str, Tensor]] | None:
    """Forward only through the training schedule and forward step, without autograd; gradient
    buffers and weights untouched. The loss reports on the last pipeline stage, None elsewhere."""
    step = megatron_forward_step(objective, normalizer, len(batches), device)
    with torch.no_grad():
        return run_schedule(ddp_chunks, step, batches, seq_length, micro_batch_size, forward_only=True)


def has_nonfinite(values: Tensor) -> bool:
    """Any inf or NaN in ``values``, exactly; the elementwise check only when the sum is not finite."""
    if torch.isfinite(values.sum()):
        return False
    return not bool(torch.isfinite(values).all())


def _grads_nonfinite(ddp_chunks: list) -> bool:
    """Any non-finite value in this rank's gradient buffers (after the DP reduction)."""
    for ddp_model in ddp_chunks:
        buffers = list(getattr(ddp_model, "buffers", [])) + list(getattr(ddp_model, "expert_parallel_buffers", []))
        for buffer in buffers:
            if has_nonfinite(buffer.grad_data):
                return True
    return False


@dataclass(frozen=True)
class MegatronPlan:
    """What :meth:`MegatronEngine.start` derived: the rank's role in the layout and the model."""

    role: RankRole
    device: torch.device
    bf16: bool
    model_args: Any  # ModelArgs, from the config and the data
    tokenizer_dir: Path  # the data's tokenizer, saved with every checkpoint

    def resolve(self, cfg: TrainConfig) -> TrainConfig:
        """``cfg`` with the model keys of the model this run builds."""
        return replace(cfg, model=recorded_model(cfg.model, self.model_args))


class MegatronEngine:
    """Megatron-Core model chunks, DDP, optimizer, schedule and torch_dist checkpoints."""

    router_losses: dict[str, float] = {}  # replaced after each MoE step (read-only here)

    def __init__(self, cfg: TrainConfig, plan: MegatronPlan, resuming: bool) -> None:
        """Build this rank's model chunks (initial weights unless ``resuming``), DDP and optimizer."""
        from megatron_wedlm.model.wedlm_model import build_model_chunks  # imports Megatron-Core

        self.cfg, self.plan, self.device = cfg, plan, plan.device
        dtype = torch.bfloat16 if plan.bf16 else torch.float32
        self.model = build_model_chunks(plan.model_args, build_settings(cfg, plan.device, dtype))
        if cfg.model.init_from is not None and not resuming:
            load_init_weights(self.model, cfg.model.init_from)
        self.ddp = wrap_ddp(self.model, cfg.optimizer.use_distributed_optimizer)
        self.optimizer = build_optimizer(cfg, self.ddp, plan.bf16)

    @classmethod
    def start(cls, cfg: TrainConfig, device: torch.device, bf16: bool, manifest: dict[str, Any]) -> MegatronPlan:
        """Check the layout and the model description, create the process groups."""
        dp_size = validate_layout(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        model_args = resolve_model_args(cfg, manifest, "bfloat16" if bf16 else "float32")
        tokenizer_dir = tokenizer_dir_of(run_data_dir(cfg), manifest)
        init_distributed(device, timeout_s=cfg.trainer.distributed_timeout_s)
        layout = initialize_parallel_state(
            ParallelConfig(
                tensor_model_parallel_size=cfg.parallelism.tp,
                pipeline_model_parallel_size=cfg.parallelism.pp,
                context_parallel_size=cfg.parallelism.cp,
                virtual_pipeline_model_parallel_size=cfg.parallelism.virtual_pp,
                sequence_parallel=cfg.parallelism.sequence_parallel,
                expert_model_parallel_size=cfg.parallelism.ep,
                expert_tensor_parallel_size=cfg.parallelism.etp,
            ),
            device=device.type,
            seed=cfg.trainer.seed,
        )
        from megatron.core import parallel_state as ps

        # the CP ranks of a replica share its rows (and the reports are already summed over DP x CP)
        first_cp = ps.get_context_parallel_rank() == 0
        role = RankRole(
            dp_rank=layout.dp_rank,
            dp_size=dp_size,
            is_logger=layout.rank == 0,
            reports_losses=ps.is_pipeline_last_stage() and layout.tp_rank == 0 and layout.dp_rank == 0 and first_cp,
            counts_tokens=layout.tp_rank == 0 and layout.pp_rank == 0 and first_cp,
            loss_group="data_parallel",  # Megatron's DP group (DP x CP for the reports)
        )
        return MegatronPlan(role, device, bf16, model_args, tokenizer_dir)

    def describe(self) -> str:
        p = self.cfg.parallelism
        chunks = f" ({p.virtual_pp} chunks per stage)" if p.virtual_pp else ""
        return f"Megatron-Core, tp {p.tp} x pp {p.pp}{chunks} x cp {p.cp} x dp {self.plan.role.dp_size}"

    # ---- state ----
    def model_shape(self) -> ModelShape:
        return ModelShape.from_model_args(self.plan.model_args)

    def _manager(self):
        return CheckpointManager(self.cfg.checkpointing.dir, self.cfg.checkpointing.keep_last)

    def load(self, path: Path) -> dict[str, Any]:
        return self._manager().load(path, self.model, self.optimizer, self.cfg.checkpointing.load_optimizer)

    def save(self, step: int, trainer_state: dict[str, Any], files: dict[str, str]) -> Path:
        """Also saves the model description and the data's tokenizer: an export needs no ``--tokenizer``."""
        model_args = json.dumps(self.plan.model_args.to_dict(), indent=2, sort_keys=True) + "\n"
        tokenizer = {file.name: file for file in tokenizer_files_in(self.plan.tokenizer_dir)}
        return self._manager().save(step, self.model, self.optimizer, trainer_state,
                                    files={**files, MODEL_ARGS_FILE: model_args, **tokenizer})

    # ---- one step ----
    def forward_backward(self, batches: Sequence[DualStreamBatch], normalizer: LossNormalizer,
                         objective: Objective) -> list[dict[str, Tensor]] | None:
        """Gradients of the step loss; the loss reports (last pipeline stage; None elsewhere)."""
        self.optimizer.zero_grad()
        reports = forward_backward_step(self.ddp, batches, normalizer, objective, self.cfg.data.seq_length,
                                        self.cfg.data.micro_batch_size, self.device)
        if self.plan.model_args.is_moe:
            self.router_losses = take_router_losses(len(batches))
        return reports

    def grads_finite(self) -> bool:
        return not _grads_nonfinite(self.ddp)

    def optimizer_step(self, apply: bool) -> StepUpdate:
        """Apply the update (Megatron clips inside) when asked, else drop the gradients."""
        if not apply:
            self.optimizer.zero_grad()
            return StepUpdate(applied=False, grad_norm=float("nan"))
        updated, grad_norm, _ = self.optimizer.step()
        return StepUpdate(applied=bool(updated), grad_norm=float(grad_norm) if grad_norm is not None else float("nan"))

    def evaluate(self, batches: Sequence[DualStreamBatch], normalizer: LossNormalizer,
                 objective: Objective) -> list[dict[str, Tensor]] | None:
        """Forward-only validation (no dropout by default, so the chunks stay in training mode)."""
        return forward_only_step(self.ddp, batches, normalizer, objective, self.cfg.data.seq_length,
                                 self.cfg.data.micro_batch_size, self.device)

    def finish(self, logger) -> None:
        """Nothing beyond the last checkpoint (``tools/convert_checkpoint.py`` exports to HF)."""
