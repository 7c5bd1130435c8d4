"""The contract between the one training loop and a model engine.

:func:`~.loop.run_training` owns the run; an engine owns the model side. An engine computes
gradients, the loop decides whether they are applied: no engine updates weights inside
:meth:`Engine.forward_backward`, only in :meth:`Engine.optimizer_step` when the loop asks, after
it summed the step's losses and gradient health over every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Sequence

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from megatron_wedlm.config.schema import TrainConfig
    from megatron_wedlm.data.dual_stream import DualStreamBatch
    from megatron_wedlm.model.losses import LossNormalizer

    from .metrics import MetricsLogger
    from .objective import Objective
    from .throughput import ModelShape

__all__ = ["Engine", "EnginePlan", "EngineType", "RankRole", "StepUpdate"]


@dataclass(frozen=True)
class RankRole:
    """Where this rank stands in the loop's bookkeeping: of the ranks holding copies of a number (TP
    peers, stages, CP ranks), the one ``reports_losses`` / ``counts_tokens`` picks counts it."""

    dp_rank: int
    dp_size: int
    is_logger: bool  # writes the console, metrics.jsonl and wandb
    reports_losses: bool  # this rank's loss reports are the step's
    counts_tokens: bool  # this rank's micro-batch tokens count towards the step's
    loss_group: Any  # the process group loss denominators and reports are summed over (None: one rank)


@dataclass(frozen=True)
class StepUpdate:
    """What :meth:`Engine.optimizer_step` did."""

    applied: bool  # the weights changed (an engine may still skip, e.g. on a fp16 overflow)
    grad_norm: float  # of the applied update; NaN when none was applied


class Engine(Protocol):
    """A built engine (the constructor built model and optimizer). Per step: ``forward_backward``,
    ``grads_finite``, ``optimizer_step``, ``evaluate`` and ``save`` when due; ``finish`` at the end."""

    optimizer: Any  # the optimizer whose param groups the lr schedule drives
    router_losses: dict[str, float]  # the last forward_backward's MoE router losses, the same on every rank; {} if dense

    def describe(self) -> str:
        """One line for the run's first message (layout, backend)."""
        ...

    def model_shape(self) -> ModelShape:
        """The built model's dimensions, for the throughput's FLOP count."""
        ...

    def load(self, path: Path) -> dict[str, Any]:
        """Load a checkpoint's tensors; returns its trainer state."""
        ...

    def save(self, step: int, trainer_state: dict[str, Any], files: dict[str, str]) -> Path:
        """Collective: save a checkpoint holding ``trainer_state`` and ``files``; returns its path."""
        ...

    def forward_backward(self, batches: Sequence[DualStreamBatch], normalizer: LossNormalizer,
                         objective: Objective) -> list[dict[str, Tensor]] | None:
        """Gradients of the step loss over this rank's micro-batches, weights untouched; the
        per-micro-batch loss reports where this rank computes losses, else None."""
        ...

    def grads_finite(self) -> bool:
        """Whether this rank's gradients of the step (after any data-parallel reduction) are finite."""
        ...

    def optimizer_step(self, apply: bool) -> StepUpdate:
        """Apply the step's gradients when ``apply``; otherwise drop them, leaving weights and
        optimizer state as they were. Either way the next step starts from clean gradients."""
        ...

    def evaluate(self, batches: Sequence[DualStreamBatch], normalizer: LossNormalizer,
                 objective: Objective) -> list[dict[str, Tensor]] | None:
        """Collective: forward only over this rank's validation micro-batches, no gradient, weight
        or optimizer change; the loss reports where this rank computes losses, else None."""
        ...

    def finish(self, logger: MetricsLogger) -> None:
        """After the last step of the run (e.g. an export)."""
        ...


class EnginePlan(Protocol):
    """What ``start`` derived before the claim (layout, model description), the engine built from it."""

    role: RankRole

    def resolve(self, cfg: TrainConfig) -> TrainConfig:
        """``cfg`` with what ``start`` derived that the run's config records (a copy)."""
        ...


class EngineType(Protocol):
    """An engine class: ``start`` checks the run and creates the process groups before the output
    directory is claimed; the constructor then builds the model and optimizer (initial weights unless
    ``resuming``)."""

    def start(self, cfg: TrainConfig, device: torch.device, bf16: bool, manifest: dict[str, Any]) -> EnginePlan:
        ...

    def __call__(self, cfg: TrainConfig, plan: Any, resuming: bool) -> Engine:
        ...
