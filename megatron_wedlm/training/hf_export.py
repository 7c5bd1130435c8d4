"""A training run's checkpoint as a model to decode: find it, export it to HF, load it.

Besides an HF directory, the decoding entry points and ``--follow`` take an ``iter_N``, a
checkpoints root or a run directory (its newest checkpoint as ``--resume auto`` picks it). A
Megatron checkpoint is exported by :func:`megatron_wedlm.conversion.convert_megatron_to_hf` into a
temporary directory and loaded from there, so what decodes is what ``megatron-to-hf`` writes;
under torchrun every rank exports its own copy (for a large model, export once).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron_wedlm.config import config_from_yaml_text
from megatron_wedlm.conversion import convert_megatron_to_hf
from megatron_wedlm.decoding import inputs as decoding_inputs
from megatron_wedlm.runtime.multiprocess import run_distributed

from .checkpoint_index import CONFIG_FILE, find_latest_checkpoint, is_complete_checkpoint

#: the HF export a DeepSpeed checkpoint holds (``deepspeed.export_hf``), loaded as it is
DEEPSPEED_EXPORT = "hf"

#: the longest an export in a child process may take (a large model on a slow disk)
EXPORT_TIMEOUT_S = 6 * 3600.0
_CHILD_ENV = {"MEGATRON_WEDLM_CPU": "0"}  # the child chooses the CPU runtime itself, and only without CUDA

__all__ = ["TrainingCheckpointError", "checkpoints_root", "load_checkpoint", "training_checkpoint"]


class TrainingCheckpointError(FileNotFoundError):
    """A training path was given that holds no usable checkpoint; the message says what to do."""


def checkpoints_root(run_dir: str | Path) -> Path:
    """Where the run in ``run_dir`` saves: ``<run_dir>/checkpoints`` if it exists, else its config's
    ``checkpointing.dir``."""
    run_dir = Path(run_dir)
    config = run_dir / CONFIG_FILE
    if not (run_dir / "checkpoints").is_dir() and config.is_file():
        configured = config_from_yaml_text(config.read_text()).checkpointing.dir
        if configured:
            return Path(configured)
    return run_dir / "checkpoints"


def _holds_iterations(path: Path) -> bool:
    return any(child.name.startswith("iter_") for child in path.iterdir())


def training_checkpoint(path: str | Path) -> Path | None:
    """The Megatron checkpoint ``path`` stands for, or None for an HF directory or no checkpoint;
    :class:`TrainingCheckpointError` for a training path without a usable checkpoint."""
    path = Path(path)
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    if path.name.startswith("iter_"):
        if not is_complete_checkpoint(path):
            raise TrainingCheckpointError(
                f"{path} is not a complete checkpoint (a save in progress or interrupted: no trainer_state.json); "
                "pass a complete iter_NNNNNNN directory or the run directory for its newest complete checkpoint"
            )
        return path
    if (path / "metadata.json").is_file():
        return path
    if _holds_iterations(path):
        root = path
    elif (path / CONFIG_FILE).is_file() or (path / "checkpoints").is_dir():
        root = checkpoints_root(path)
    else:
        return None
    latest = find_latest_checkpoint(root)
    if latest is None:
        raise TrainingCheckpointError(
            f"{path} holds no complete checkpoint yet (looked in {root} for iter_NNNNNNN directories with a "
            "trainer_state.json); wait for the run's first save"
        )
    return latest


def load_checkpoint(
    path: str | Path, device: str | None = None, dtype: str = "auto", require_mask_token: bool = True,
    **placement: Any,
) -> tuple[Any, Any]:
    """(model, tokenizer) of an HF directory or a training path; arguments as
    :func:`megatron_wedlm.decoding.inputs.load_checkpoint`."""
    checkpoint = training_checkpoint(path)
    if checkpoint is None:
        return decoding_inputs.load_checkpoint(path, device=device, dtype=dtype, require_mask_token=require_mask_token,
                                               **placement)
    if (checkpoint / DEEPSPEED_EXPORT / "config.json").is_file():
        return decoding_inputs.load_checkpoint(checkpoint / DEEPSPEED_EXPORT, device=device, dtype=dtype,
                                               require_mask_token=require_mask_token, **placement)
    if not (checkpoint / "metadata.json").is_file():
        raise TrainingCheckpointError(
            f"{checkpoint} holds neither Megatron weights (metadata.json) nor an HF export ({DEEPSPEED_EXPORT}/): "
            "a DeepSpeed checkpoint saved with deepspeed.export_hf=false; pass the run's final export "
            "(<trainer.output_dir>/hf) or save checkpoints with deepspeed.export_hf=true"
        )
    with tempfile.TemporaryDirectory(prefix=f"wedlm-{checkpoint.name}-") as tmp:
        export = Path(tmp) / "hf"
        if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) > 1:
            # A rank of a launch (torchrun): the conversion needs a process group of its own.
            threads = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
            run_distributed(_export, 1, str(checkpoint), str(export), require_mask_token,
                            timeout_s=EXPORT_TIMEOUT_S, env=_CHILD_ENV | threads)
        else:
            _export(str(checkpoint), str(export), require_mask_token)
        # loaded into memory; on Linux even weights still mapped from the files outlive their removal
        return decoding_inputs.load_checkpoint(export, device=device, dtype=dtype,
                                               require_mask_token=require_mask_token, **placement)


def _export(checkpoint: str, output: str, require_mask_token: bool) -> None:
    convert_megatron_to_hf(checkpoint, output, require_mask_token=require_mask_token)
