"""Megatron DDP, the (distributed) optimizer and the lr schedule: Megatron-Core's own classes,
with config keys mapped onto them, so a run behaves like a Megatron-LM run with the same settings.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_wedlm.config.schema import TrainConfig

from megatron_wedlm.runtime.megatron_compat import patch_native_adam_step_restore

__all__ = ["wrap_ddp", "build_optimizer", "build_scheduler", "current_lr"]


def wrap_ddp(chunks: list, use_distributed_optimizer: bool) -> list:
    """Megatron ``DistributedDataParallel`` around each model chunk, plus the config hooks its
    schedules call: ``finalize_model_grads`` all-reduces gradients over DP x CP (and shared ones across
    stages and TP ranks); ``no_sync`` defers the DP reduction to the last micro-batch."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    wrapped = [
        DistributedDataParallel(
            config=chunk.config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=False,
                use_distributed_optimizer=use_distributed_optimizer,
                check_for_nan_in_grad=False,  # non-finite steps are skipped and counted by the loop
            ),
            module=chunk,
        )
        for chunk in chunks
    ]
    no_sync = [ddp.no_sync for ddp in wrapped]
    for chunk in chunks:
        chunk.config.finalize_model_grads_func = finalize_model_grads
        chunk.config.no_sync_func = no_sync if len(no_sync) > 1 else no_sync[0]
    return wrapped


def build_optimizer(cfg: TrainConfig, ddp_chunks: list, bf16: bool):
    """``get_megatron_optimizer`` over the DDP-wrapped chunks: Adam(W) or SGD, gradient clipping,
    weight decay."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    o = cfg.optimizer
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer=o.name,
            lr=o.lr,
            min_lr=o.min_lr,
            weight_decay=o.weight_decay,
            adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2,
            adam_eps=o.adam_eps,
            clip_grad=o.clip_grad,
            bf16=bf16,
            params_dtype=torch.bfloat16 if bf16 else torch.float32,
            use_distributed_optimizer=o.use_distributed_optimizer,
        ),
        list(ddp_chunks),
    )
    patch_native_adam_step_restore(optimizer)
    return optimizer


def build_scheduler(cfg: TrainConfig, optimizer):
    """Megatron's ``OptimizerParamScheduler``: warmup from 0, then decay to ``min_lr``. Update ``n``
    uses the lr of ``n`` scheduler steps, so with warmup the first update has lr 0."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    o = cfg.optimizer
    decay_steps = o.decay_steps or cfg.trainer.train_steps
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if o.warmup_steps else o.lr,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=o.warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=o.decay_style,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )


def current_lr(optimizer) -> float:
    groups: Any = optimizer.param_groups
    for group in groups:
        if group.get("default_config", True):
            return float(group["lr"])
    return float(groups[0]["lr"])
