"""Megatron ``forward_step_func``s for the two training modes.

* WeDLM (``wedlm.enabled=true``): :func:`megatron_wedlm.model.losses.wedlm_forward_step` --
  MLM on masked prediction slots + AR on the memory stream, globally normalised.
* AR (``wedlm.enabled=false``): rows hold only the memory stream, the objective is the mean
  next-token cross entropy over the global batch. It reuses the WeDLM label row and loss
  report (the MLM part is simply empty), so both modes log the same fields; only the
  differentiated quantity differs (the AR term alone instead of ``(mlm + w ar) / (1 + w)``).
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
from torch import Tensor

from megatron_wedlm.config.schema import TrainConfig
from megatron_wedlm.data.dual_stream import DualStreamBatch

__all__ = ["make_forward_step", "logged_loss"]


def _ar_schedule_loss(batch: DualStreamBatch, normalizer, num_microbatches: int, output_tensor: Tensor):
    from megatron_wedlm.model.losses import ar_mode_loss, schedule_loss_scale

    contribution, loss = ar_mode_loss(
        output_tensor, batch.is_masked, batch.mlm_weights, batch.ar_labels, normalizer=normalizer
    )
    return contribution * schedule_loss_scale(num_microbatches), loss.report()


def _ar_forward_step(normalizer, num_microbatches: int, device) -> Callable:
    from megatron_wedlm.model.losses import run_model_on_shard

    def forward_step(data_iterator, model):
        batch, output = run_model_on_shard(model, next(data_iterator).to(device))
        return output, partial(_ar_schedule_loss, batch, normalizer, num_microbatches)

    return forward_step


def make_forward_step(cfg: TrainConfig, normalizer, num_microbatches: int, device: torch.device) -> Callable:
    """The forward step for this step's micro-batches (``normalizer``: global denominators)."""
    if cfg.wedlm.enabled:
        from megatron_wedlm.model.losses import wedlm_forward_step

        return wedlm_forward_step(
            normalizer,
            num_microbatches,
            ar_weight=cfg.wedlm.ar_weight,
            mlm_weighting=cfg.wedlm.loss_weighting,  # type: ignore[arg-type]
            device=device,
        )
    return _ar_forward_step(normalizer, num_microbatches, device)


def logged_loss(cfg: TrainConfig, summary) -> float:
    """The number reported as ``loss``: the differentiated objective of the mode."""
    return float(summary.total) if cfg.wedlm.enabled else float(summary.ar)
