"""The run's validation curve: the objective on fixed held-out rows every ``trainer.eval_interval`` steps.

The rows of :mod:`megatron_wedlm.data.validation_rows` (same rows and masks each time) go through
the engine's forward-only :meth:`~.engine.Engine.evaluate`; the loss is normalised over the whole
evaluation as a step's is over its global batch (summed reports over the global denominators,
:func:`~megatron_wedlm.model.losses.reduce_loss_reports`), not a mean of per-batch means.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from megatron_wedlm.config.schema import TrainConfig
from megatron_wedlm.data.validation_rows import ValidationRows
from megatron_wedlm.model.losses import global_loss_normalizer, reduce_loss_reports

from .engine import Engine, RankRole
from .objective import Objective
from .step_record import StepTotals

__all__ = ["Validator"]


class Validator:
    """When a run validates and what one validation logs (``valid/*`` keys of a step record)."""

    def __init__(self, cfg: TrainConfig, rows: ValidationRows, objective: Objective, role: RankRole,
                 device: torch.device, end_step: int) -> None:
        self.interval = cfg.trainer.eval_interval
        self.end_step = end_step
        self.rows = rows
        self.objective = objective
        self.role = role
        self.device = device
        # collective, once: the rows (and so the denominators) are the same at every evaluation
        self.normalizer = global_loss_normalizer(rows.batches, objective.mlm_weighting, group=role.loss_group)

    def describe(self) -> str:
        wrapped = (f"; the directory holds fewer rows, so its documents are read {self.rows.passes} times "
                   "(wrapping around as training epochs do)") if self.rows.passes > 1 else ""
        return (f"validation every {self.interval} steps and after step {self.end_step}: {self.rows.rows} rows "
                f"({len(self.rows.batches)} micro-batches per data-parallel rank){wrapped}")

    def due(self, step: int) -> bool:
        return step % self.interval == 0 or step == self.end_step

    def run(self, engine: Engine) -> dict[str, Any]:
        """Collective: one evaluation; the ``valid/*`` numbers (global)."""
        started = time.perf_counter()
        reports = engine.evaluate(self.rows.batches, self.normalizer, self.objective)
        local = StepTotals()
        if reports is not None:
            summary = reduce_loss_reports(reports, self.objective.ar_weight, group=self.role.loss_group)
            if self.role.reports_losses:
                local.loss, local.mlm, local.ar = self.objective.logged_loss(summary), summary.mlm, summary.ar
                local.masked_tokens, local.ar_tokens = summary.mlm_tokens, summary.ar_tokens
        if self.role.counts_tokens:
            local.tokens = float(sum(self.rows.tokens))
        totals = local.summed_over_ranks(self.device)
        return {
            "valid/loss": totals.loss,
            "valid/mlm_loss": totals.mlm,
            "valid/ar_loss": totals.ar,
            "valid/masked_tokens": int(totals.masked_tokens),
            "valid/ar_tokens": int(totals.ar_tokens),
            "valid/tokens": int(totals.tokens),
            "valid/time_s": time.perf_counter() - started,
        }
