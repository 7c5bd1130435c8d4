"""WeDLM SFT of HF checkpoints under DeepSpeed ZeRO (``trainer.backend=deepspeed``), no conversion:
the Megatron path's rows, losses, schedule, data, checkpoint conventions and logging, with an
unmodified transformers ``*ForCausalLM`` under ZeRO-1/2/3 (optionally offloaded to the CPU).

:mod:`.settings` (checks, the DeepSpeed JSON), :mod:`.hf_model` (loading, mask-token row,
weight-decay groups), :mod:`.forward` (the dual-stream forward), :mod:`.checkpoint`, :mod:`.engine`
(:class:`DeepSpeedEngine` for the one loop) and :mod:`.cli`. Importing it does not import DeepSpeed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DeepSpeedConfig", "DualStreamCausalLM", "run_deepspeed_sft"]


def __getattr__(name: str) -> Any:
    if name == "run_deepspeed_sft":
        from .engine import run_deepspeed_sft

        return run_deepspeed_sft
    if name == "DeepSpeedConfig":
        from megatron_wedlm.config.schema import DeepSpeedConfig

        return DeepSpeedConfig
    if name == "DualStreamCausalLM":
        from .forward import DualStreamCausalLM

        return DualStreamCausalLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
