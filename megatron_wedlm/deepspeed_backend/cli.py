"""Command line of ``sft/sft_wedlm.py ... trainer.backend=deepspeed``: the Megatron entry point's
arguments; ``sft/sft_wedlm.py`` offers :data:`DEEPSPEED` next to Megatron and the config picks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from megatron_wedlm.training.cli import run_entry_point

from .settings import validate_deepspeed_run

if TYPE_CHECKING:
    from megatron_wedlm.config.schema import TrainConfig

__all__ = ["DEEPSPEED", "main"]


def _check(cfg: TrainConfig) -> None:
    validate_deepspeed_run(cfg)


def _train(cfg: TrainConfig) -> Any:
    from .engine import run_deepspeed_sft  # imports torch

    return run_deepspeed_sft(cfg)


#: ``trainer.backend=deepspeed`` for :func:`megatron_wedlm.training.cli.run_entry_point`
DEEPSPEED = {"deepspeed": (_check, _train)}


def main(argv: Sequence[str] | None = None, task: str = "sft") -> int:
    """Exit codes as the Megatron entry point: 0 ok, 1 crash, 2 config error, 3 non-finite stop."""
    return run_entry_point(argv, task, DEEPSPEED)
