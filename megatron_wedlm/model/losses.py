"""WeDLM training losses under tensor parallelism, globally normalised over the step.

Per slot, one vocab-parallel cross entropy (``tensor_parallel.vocab_parallel_cross_entropy``,
inside ``GPTModel.compute_language_model_loss``) serves both losses, because their slots are
disjoint: masked prediction-stream slots predict their *own* token (MLM, no shift), memory
slots predict the next token (AR). :func:`wedlm_labels` builds that single label row.

Loss (docs/method.md §2.4)::

    mlm   = sum_i w_i * ce_i / sum_i w_i        over masked slots i, w_i = 1/gamma (or 1: "uniform")
    ar    = sum_j ce_j / N_ar                   over memory slots j with a next-token label
    total = (mlm + ar_weight * ar) / (1 + ar_weight)

Global normalisation: the sums run over the *global* batch -- every micro-batch of the step
on every data-parallel rank. A micro-batch cannot know the global denominators, so they are
computed up front from the step's data (cheap: they depend only on masks and labels, not on
the model) with :func:`global_loss_normalizer` -- local sums over the rank's micro-batches,
all-reduced over the data-parallel group. Each micro-batch then contributes
``(sum_mb w*ce / W + ar_weight * sum_mb ce / N) / (1 + ar_weight)``; the contributions add
up to exactly ``total``.

The report carries raw sums; :func:`reduce_loss_reports` turns the reports of a step (over
DP x CP) into the global total / MLM / AR losses and token counts. How a micro-batch's
contribution reaches a schedule is the engines' business
(:mod:`megatron_wedlm.training.megatron_engine`, :mod:`megatron_wedlm.deepspeed_backend.engine`).
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
        """Denominators of a single batch (the normaliser when there is nothing else)."""
        w = mlm_slot_weights(is_masked, mlm_weights, mlm_weighting)
        return cls(float(w.double().sum()), float((ar_labels >= 0).sum()))


def _sum_over(
    values: Tensor, group: dist.ProcessGroup | None | Literal["data_parallel"], with_context_parallel: bool
) -> Tensor:
    """``values`` (float64, on the CPU) summed over ``group``: ``"data_parallel"`` is Megatron's
    DP group (with the CP ranks when ``with_context_parallel``); None, or a group of one, keeps
    them as they are."""
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
    """Denominators over this rank's micro-batches of a step, all-reduced over ``group``.

    ``group="data_parallel"`` (default) uses Megatron's data-parallel group; ``None`` skips the
    reduction (single process, or when the caller already holds the global batch). Every rank
    of the group must call this with its own micro-batches.
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
    """Loss of one (micro-)batch. ``total`` carries the gradient; the rest are detached reports.

    ``total`` is this batch's contribution to the normalised step loss (equal to the batch's
    own total when the normaliser is the batch's own); ``ar_term`` is its AR part alone
    (``ar_sum / N_ar``, also with the gradient). ``mlm`` / ``ar`` are this batch's weighted
    means; the raw sums let reports be combined exactly.
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
    """Combine per-slot cross entropy ``[B, S]`` (from the model given :func:`wedlm_labels`).

    ``normalizer`` None normalises over this batch alone. A part with no tokens (no masked
    slot, or no AR label) contributes zero. ``ar_weight=0`` drops the AR term (still reported).
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
    """The objective of AR mode (``wedlm.enabled=false``) and the loss report.

    AR rows hold only the memory stream, so the objective is the next-token term alone,
    ``sum_j ce_j / N_ar`` with the global ``N_ar`` of ``normalizer``. The report is the WeDLM
    one (its MLM part empty), so both modes log the same fields. Both backends call this.
    """
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
    """Sum the micro-batch reports of a step (and over ``group``) into global losses.

    Call on the last pipeline stage (the only one with reports). With the normaliser from
    :func:`global_loss_normalizer` the returned ``total`` is exactly the loss that was
    differentiated. ``"data_parallel"`` means DP x CP: under context parallelism each rank's
    reports cover only its own slots.
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
