"""Reading what a checkpoint directory holds, for tests that compare tensors exactly."""

from __future__ import annotations

from pathlib import Path

import torch


def safetensors_of(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` file in ``directory`` (a sharded export included)."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors
