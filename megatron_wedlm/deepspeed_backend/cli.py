"""Command line of ``sft/sft_wedlm.py ... trainer.backend=deepspeed``.

    torchrun --nproc_per_node G sft/sft_wedlm.py --config configs/sft/qwen3_8b_deepspeed.yaml \\
        model.init_from=/models/Qwen3-8B data.path=/data/sft trainer.backend=deepspeed

The arguments are the Megatron entry point's (``--config``, ``--resume``, ``--print-config``,
``--result-json``, ``key=value`` overrides); the entry point hands a command line over here when
``trainer.backend=deepspeed`` (override or YAML, :func:`megatron_wedlm.training.cli.requested_backend`).
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None, task: str = "sft") -> int:
    """Exit codes as the Megatron entry point: 0 ok, 1 crash, 2 config error, 3 non-finite stop."""
    from megatron_wedlm.training.cli import run_entry_point

    from .settings import validate_deepspeed_run
    from .engine import run_deepspeed_sft

    return run_entry_point(argv, task, validate_deepspeed_run, run_deepspeed_sft)
