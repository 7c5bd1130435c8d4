"""What a run optimises: WeDLM (``wedlm.enabled=true``) or plain next-token AR, for both engines.
One object gives the label row, the differentiated contribution with its loss report and the
logged ``loss``, so no loop or forward step asks ``if cfg.wedlm.enabled``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from megatron_wedlm.config.schema import TrainConfig
from megatron_wedlm.data.dual_stream import DualStreamBatch
from megatron_wedlm.model.losses import (
    LossNormalizer,
    MlmWeighting,
    WeDLMLoss,
    WeDLMLossSummary,
    ar_mode_loss,
    wedlm_labels,
    wedlm_loss,
)

__all__ = ["Objective"]


@dataclass(frozen=True)
class Objective:
    """The training objective of a run (see the module docstring)."""

    wedlm: bool = True
    ar_weight: float = 1.0
    mlm_weighting: MlmWeighting = "inverse_ratio"

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> "Objective":
        return cls(cfg.wedlm.enabled, cfg.wedlm.ar_weight, cfg.wedlm.loss_weighting)  # type: ignore[arg-type]

    @property
    def name(self) -> str:
        return "WeDLM" if self.wedlm else "AR"

    def labels(self, batch: DualStreamBatch) -> Tensor:
        """The one label row the model's per-slot cross entropy is computed against."""
        return wedlm_labels(batch.is_masked, batch.target_ids, batch.ar_labels)

    def contribution(
        self, per_slot_ce: Tensor, batch: DualStreamBatch, normalizer: LossNormalizer | None
    ) -> tuple[Tensor, WeDLMLoss]:
        """(this micro-batch's share of the step loss, with the gradient; its loss report).
        ``normalizer``: the step's global denominators (None: this batch alone)."""
        if not self.wedlm:
            return ar_mode_loss(per_slot_ce, batch.is_masked, batch.mlm_weights, batch.ar_labels, normalizer=normalizer)
        loss = wedlm_loss(
            per_slot_ce, batch.is_masked, batch.mlm_weights, batch.ar_labels,
            ar_weight=self.ar_weight, mlm_weighting=self.mlm_weighting, normalizer=normalizer,
        )
        return loss.total, loss

    def logged_loss(self, summary: WeDLMLossSummary) -> float:
        """The number reported as ``loss``: the differentiated objective of the mode."""
        return float(summary.total) if self.wedlm else float(summary.ar)
