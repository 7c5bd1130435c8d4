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
    from megatron.core import parallel_state as ps

    from megatron_wedlm.model.losses import ar_mode_loss

    contribution, loss = ar_mode_loss(
        output_tensor, batch.is_masked, batch.mlm_weights, batch.ar_labels, normalizer=normalizer
    )
    # Megatron divides by the micro-batch count and DDP averages over DP: undo both (see losses.py)
    dp_size = ps.get_data_parallel_world_size(with_context_parallel=True)
    return contribution * (num_microbatches * dp_size), loss.report()


def _ar_forward_step(normalizer, num_microbatches: int, device) -> Callable:
    from megatron_wedlm.model.attention import pack_attention_metadata
    from megatron_wedlm.model.losses import wedlm_labels

    def forward_step(data_iterator, model):
        batch: DualStreamBatch = next(data_iterator).to(device)
        output = model(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            attention_mask=pack_attention_metadata(batch.attention_metadata()),
            labels=wedlm_labels(batch.is_masked, batch.target_ids, batch.ar_labels),
        )
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
