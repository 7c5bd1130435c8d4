"""The ``deepspeed`` section of the training config (``TrainConfig.deepspeed``).

It imports nothing from the project, so :mod:`megatron_wedlm.config.schema` can hold it as a
section without an import cycle. Its values are checked by
:func:`megatron_wedlm.config.validate_config`; the rules of a DeepSpeed run by :mod:`.settings`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["DeepSpeedConfig"]


@dataclass
class DeepSpeedConfig:
    """ZeRO settings of ``trainer.backend=deepspeed`` (HF checkpoints, no conversion).

    ``model.init_from`` is then a HF model directory (Qwen2 / Qwen3 / Llama / official WeDLM);
    ``parallelism.recompute`` != none turns on per-layer activation checkpointing."""

    zero_stage: int = 2  # 1 | 2 | 3
    offload_optimizer: str = "none"  # none | cpu: optimizer states and step on the CPU (DeepSpeedCPUAdam)
    offload_params: str = "none"  # none | cpu: ZeRO-3 only, parameters live on the CPU between uses
    zero3_init: bool = True  # ZeRO-3: build/load the model already partitioned (needs `accelerate`)
    export_hf: bool = True  # also write a HF export (iter_N/hf) at every checkpoint save
    extra_config: Optional[str] = None  # JSON file merged last into the generated DeepSpeed config
