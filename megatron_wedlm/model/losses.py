"""WeDLM training losses under tensor parallelism, globally normalised over the step.

The formulas and why one label row serves both losses: docs/method.md §2.4. The denominators
of the whole step (all micro-batches on all DP ranks) are computed up front
(:func:`global_loss_normalizer`), so the micro-batches' contributions add up exactly to the
step loss; :func:`reduce_loss_reports` turns a step's reports (over DP x CP) into global losses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Literal, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_wedlm.data.dual_stream import IGNORE_INDEX, DualStreamBatch


__all__ = [
    "LossNormalizer",
    "MlmWeighting",
    "WeDLMLoss",
    "WeDLMLossSummary",
    "ar_mode_loss",
    "global_loss_normalizer",
    "reduce_loss_reports",
    "wedlm_labels",
    "wedlm_loss",
]

MlmWeighting = Literal["inverse_ratio", "uniform"]
REPORT_KEYS = ("mlm_weighted_sum", "mlm_weight_sum", "mlm_tokens", "ar_sum", "ar_tokens")


def _check_weighting(mlm_weighting: str) -> None:
    if mlm_weighting not in ("inverse_ratio", "uniform"):
        raise ValueError(f"mlm_weighting must be 'inverse_ratio' (1/gamma) or 'uniform', got {mlm_weighting!r}")


def wedlm_labels(is_masked: Tensor, target_ids: Tensor, ar_labels: Tensor) -> Tensor:
    """One label per slot: own token on masked slots, next token on memory slots, -100 elsewhere."""
    return torch.where(is_masked, target_ids, ar_labels.masked_fill(ar_labels < 0, IGNORE_INDEX))


def mlm_slot_weights(is_masked: Tensor, mlm_weights: Tensor, mlm_weighting: MlmWeighting) -> Tensor:
    _check_weighting(mlm_weighting)
    if mlm_weighting == "uniform":
        return is_masked.float()
    return torch.where(is_masked, mlm_weights.float(), torch.zeros_like(mlm_weights, dtype=torch.float32))


@dataclass(frozen=True)
class LossNormalizer:
    """Global denominators of one optimizer step: MLM weight sum and AR token count."""

    mlm_weight_sum: float
    ar_token_count: float

    @classmethod
    def of(cls, is_masked: Tensor, mlm_weights: Tensor, ar_labels: Tensor,
           mlm_weighting: MlmWeighting = "inverse_ratio") -> "LossNormalizer":
        """Denominators of a single batch."""
        w = mlm_slot_weights(is_masked, mlm_weights, mlm_weighting)
        return cls(float(w.double().sum()), float((ar_labels >= 0).sum()))


def _sum_over(
    values: Tensor, group: dist.ProcessGroup | None | Literal["data_parallel"], with_context_parallel: bool
) -> Tensor:
    """``values`` (float64, CPU) summed over ``group``; None: as they are."""
    if group == "data_parallel":
        from megatron.core import parallel_state as ps

        initialized = ps.model_parallel_is_initialized()
        group = ps.get_data_parallel_group(with_context_parallel=with_context_parallel) if initialized else None
    if group is None or not dist.is_initialized() or dist.get_world_size(group) <= 1:
        return values
    reduced = values.to("cuda" if dist.get_backend(group) == "nccl" else "cpu")
    dist.all_reduce(reduced, group=group)
    return reduced.cpu()


def global_loss_normalizer(
    batches: Iterable[DualStreamBatch],
    mlm_weighting: MlmWeighting = "inverse_ratio",
    group: dist.ProcessGroup | None | Literal["data_parallel"] = "data_parallel",
) -> LossNormalizer:
    """Denominators over this rank's micro-batches of a step, all-reduced over ``group`` (None:
    not reduced); every rank of the group must call it.
    """
    totals = torch.zeros(2, dtype=torch.float64)
    for batch in batches:
        w = mlm_slot_weights(batch.is_masked, batch.mlm_weights, mlm_weighting)
        totals[0] += w.double().sum().cpu()
        totals[1] += (batch.ar_labels >= 0).sum().double().cpu()
    totals = _sum_over(totals, group, with_context_parallel=False)
    return LossNormalizer(float(totals[0]), float(totals[1]))


@dataclass
class WeDLMLoss:
    """Loss of one (micro-)batch: ``total`` (its share of the step loss) and ``ar_term`` carry the
    gradient; ``mlm``/``ar`` and the raw sums are detached reports.
    """

    total: Tensor
    ar_term: Tensor
    mlm: Tensor
    ar: Tensor
    mlm_tokens: Tensor
    ar_tokens: Tensor
    mlm_weighted_sum: Tensor
    mlm_weight_sum: Tensor
    ar_sum: Tensor

    def report(self) -> dict[str, Tensor]:
        return {key: getattr(self, key).detach().reshape(()).float() for key in REPORT_KEYS}


def wedlm_loss(
    per_slot_ce: Tensor,
    is_masked: Tensor,
    mlm_weights: Tensor,
    ar_labels: Tensor,
    *,
    ar_weight: float = 1.0,
    mlm_weighting: MlmWeighting = "inverse_ratio",
    normalizer: LossNormalizer | None = None,
) -> WeDLMLoss:
    """Combine per-slot cross entropy ``[B, S]`` (labels from :func:`wedlm_labels`); ``normalizer``
    None: this batch alone. An empty part contributes zero; ``ar_weight=0`` drops the AR term.
    """
    if ar_weight < 0:
        raise ValueError(f"ar_weight must be >= 0, got {ar_weight}")
    if per_slot_ce.shape != is_masked.shape:
        raise ValueError(f"per-slot loss {tuple(per_slot_ce.shape)} does not match the batch {tuple(is_masked.shape)}")
    ce = per_slot_ce.float()
    w = mlm_slot_weights(is_masked, mlm_weights, mlm_weighting).to(ce.device)
    ar_mask = (ar_labels >= 0).to(ce.device)
    mlm_weighted_sum = (ce * w).sum()
    mlm_weight_sum = w.sum()
    ar_sum = torch.where(ar_mask, ce, torch.zeros_like(ce)).sum()
    ar_tokens = ar_mask.sum().float()
    if normalizer is None:
        normalizer = LossNormalizer(float(mlm_weight_sum), float(ar_tokens))
    mlm_term = mlm_weighted_sum / normalizer.mlm_weight_sum if normalizer.mlm_weight_sum > 0 else ce.sum() * 0.0
    ar_term = ar_sum / normalizer.ar_token_count if normalizer.ar_token_count > 0 else ce.sum() * 0.0
    total = (mlm_term + ar_weight * ar_term) / (1.0 + ar_weight)
    with torch.no_grad():
        mlm = mlm_weighted_sum / mlm_weight_sum.clamp(min=1e-30) if mlm_weight_sum > 0 else mlm_weighted_sum * 0
        ar = ar_sum / ar_tokens.clamp(min=1.0)
    return WeDLMLoss(
        total=total,
        ar_term=ar_term,
        mlm=mlm.detach(),
        ar=ar.detach(),
        mlm_tokens=is_masked.to(ce.device).sum().float(),
        ar_tokens=ar_tokens,
        mlm_weighted_sum=mlm_weighted_sum.detach(),
        mlm_weight_sum=mlm_weight_sum.detach(),
        ar_sum=ar_sum.detach(),
    )


def ar_mode_loss(
    per_slot_ce: Tensor,
    is_masked: Tensor,
    mlm_weights: Tensor,
    ar_labels: Tensor,
    *,
    normalizer: LossNormalizer | None = None,
) -> tuple[Tensor, WeDLMLoss]:
    """AR mode's objective (the next-token term, global ``N_ar``) and a WeDLM-shaped report."""
    loss = wedlm_loss(per_slot_ce, is_masked, mlm_weights, ar_labels, ar_weight=1.0, normalizer=normalizer)
    return loss.ar_term, loss


@dataclass(frozen=True)
class WeDLMLossSummary:
    """Global losses of a step, as the optimiser saw them."""

    total: float
    mlm: float
    ar: float
    mlm_tokens: int
    ar_tokens: int
    mlm_weight_sum: float


def reduce_loss_reports(
    reports: Sequence[dict[str, Tensor]],
    ar_weight: float = 1.0,
    group: dist.ProcessGroup | None | Literal["data_parallel"] = "data_parallel",
) -> WeDLMLossSummary:
    """Sum a step's micro-batch reports (and over ``group``: DP x CP) into global losses, on the
    last pipeline stage; with :func:`global_loss_normalizer`'s denominators ``total`` is the
    loss used.
    """
    sums = torch.zeros(len(REPORT_KEYS), dtype=torch.float64)
    for report in reports:
        sums += torch.stack([report[key].detach().double().cpu() for key in REPORT_KEYS])
    sums = _sum_over(sums, group, with_context_parallel=True)
    mlm_weighted_sum, mlm_weight_sum, mlm_tokens, ar_sum, ar_tokens = sums.tolist()
    mlm = mlm_weighted_sum / mlm_weight_sum if mlm_weight_sum > 0 else 0.0
    ar = ar_sum / ar_tokens if ar_tokens > 0 else 0.0
    mlm_part = mlm if mlm_weight_sum > 0 else 0.0
    ar_part = ar if ar_tokens > 0 else 0.0
    total = (mlm_part + ar_weight * ar_part) / (1.0 + ar_weight)
    return WeDLMLossSummary(total, mlm, ar, int(round(mlm_tokens)), int(round(ar_tokens)), mlm_weight_sum)
