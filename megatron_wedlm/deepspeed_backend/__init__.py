"""WeDLM SFT of HF checkpoints under DeepSpeed ZeRO (``trainer.backend=deepspeed``), no conversion.

For teams that instruct-tune from a HF checkpoint: the same dual-stream rows, losses, lr
schedule, data pipeline, checkpoint conventions and logging as the Megatron path, with the
model an unmodified transformers ``*ForCausalLM`` trained by DeepSpeed ZeRO-1/2/3 (optionally
with optimizer / parameter offload to the CPU).

* :mod:`.settings`   -- the backend's checks of a run, the DeepSpeed JSON config;
* :mod:`.hf_model`   -- loading (Qwen2 / Qwen3 / Llama / official WeDLM), mask-token row,
  Megatron-style weight-decay groups;
* :mod:`.forward`    -- the dual-stream forward through transformers' attention interface
  (SDPA + 4-D float mask on CPU, FlexAttention ``BlockMask`` on GPU) and the WeDLM objective;
* :mod:`.checkpoint` -- DeepSpeed checkpoints with exact resume, HF exports;
* :mod:`.engine`     -- :class:`DeepSpeedEngine` for the one training loop, :func:`run_deepspeed_sft`;
* :mod:`.cli`        -- the command line behind ``sft/sft_wedlm.py ... trainer.backend=deepspeed``.

Importing this package does not import DeepSpeed; the trainer does (set ``DS_ACCELERATOR=cpu``
on machines without a GPU, which the trainer does for ``trainer.device=cpu``).
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
