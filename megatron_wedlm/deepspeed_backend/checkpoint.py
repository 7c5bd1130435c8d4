"""DeepSpeed training checkpoints (exact resume) and HF exports of the trained model.

An ``iter_N`` directory with the Megatron path's conventions (:mod:`megatron_wedlm.training.checkpoint_index`)
holding ``deepspeed/`` (``engine.save_checkpoint``: weights and every rank's ZeRO partition),
``rng/rank<r>.pt``, optionally ``hf/`` (``deepspeed.export_hf``), ``trainer_state.json`` and
``config.yaml``. An HF export is ``save_pretrained``'s output plus the data's tokenizer, so
``load_wedlm_model`` and ``AutoModelForCausalLM`` load it as it is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from megatron_wedlm.runtime.atomic_output import atomic_output_dir, disk_full_is_named
from megatron_wedlm.training.checkpoint_index import (
    CheckpointDirectory,
    CheckpointReadError,
    host_rng_state,
    read_trainer_state,
    set_host_rng_state,
)
from megatron_wedlm.training.hf_export import DEEPSPEED_EXPORT

__all__ = ["DEEPSPEED_TAG", "HF_EXPORT_DIR", "DeepSpeedCheckpointManager", "export_hf_model", "full_state_dict"]

DEEPSPEED_TAG = "deepspeed"
HF_EXPORT_DIR = DEEPSPEED_EXPORT  # where the decoding entry points look for it, too
_RNG_DIR = "rng"
_WRAPPER_PREFIX = "hf_model."


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def full_state_dict(engine) -> dict[str, torch.Tensor] | None:
    """The HF model's full state dict on rank 0 (None elsewhere). Collective under ZeRO-3."""
    if engine.zero_optimization_partition_weights():
        state = engine._zero3_consolidated_16bit_state_dict()
    else:
        state = engine.module.state_dict() if _rank() == 0 else None
    if state is None:
        return None
    return {
        name[len(_WRAPPER_PREFIX):]: tensor.detach().cpu()
        for name, tensor in state.items()
        if name.startswith(_WRAPPER_PREFIX)
    }


def export_hf_model(engine, hf_model: nn.Module, directory: str | Path, tokenizer_dir: str | Path | None) -> Path:
    """Collective: write a HF export of the engine's weights to ``directory`` (rank 0 writes); an
    earlier export there is replaced only once the new one is complete."""
    from megatron_wedlm.conversion.tokenizer_files import copy_tokenizer_files, tokenizer_files_in  # imports safetensors

    directory = Path(directory)
    state = full_state_dict(engine)
    if _rank() == 0:
        assert state is not None
        if getattr(hf_model.config, "mask_token_id", None) is None:
            raise ValueError("the model's config has no mask_token_id; refusing to export a non-WeDLM checkpoint")
        tokenizer_files = tokenizer_files_in(tokenizer_dir) if tokenizer_dir is not None else []
        with atomic_output_dir(directory, inputs=tokenizer_files, overwrite=True) as staging:
            hf_model.save_pretrained(str(staging), state_dict=state)
            if tokenizer_dir is not None:
                copy_tokenizer_files(tokenizer_dir, staging)
    _barrier()
    return directory


class DeepSpeedCheckpointManager(CheckpointDirectory):
    """Saves and loads DeepSpeed checkpoints under ``root`` (publishing and pruning as the Megatron path)."""

    def save(  # type: ignore[override]
        self,
        step: int,
        engine,
        trainer_state: dict[str, Any],
        files: dict[str, str],
        export: Callable[[Path], Any] | None = None,
    ) -> Path:
        """Collective. ``export(dir)`` (collective too) writes the HF export into the checkpoint."""
        final, partial = self.begin_save(step)
        (partial / _RNG_DIR).mkdir(exist_ok=True)  # every rank writes its own file here; they race to create it
        with disk_full_is_named(partial):
            engine.save_checkpoint(str(partial), tag=DEEPSPEED_TAG, client_state={}, save_latest=False)
            torch.save(host_rng_state(), partial / _RNG_DIR / f"rank{_rank()}.pt")
        if export is not None:
            export(partial / HF_EXPORT_DIR)
        world = dist.get_world_size() if dist.is_initialized() else 1
        state = {**trainer_state, "step": step, "layout": {"backend": "deepspeed", "world_size": world}}
        return self.finish_save(partial, final, state, files)

    def load(self, path: str | Path, engine, load_optimizer: bool = True) -> dict[str, Any]:  # type: ignore[override]
        """Load weights (optimizer states and RNG when asked) into ``engine``; return the trainer state.
        ZeRO partitions belong to ranks: optimizer states reload only under the saving world size."""
        path = Path(path)
        state = read_trainer_state(path)
        layout = state.get("layout", {})
        if layout.get("backend") != "deepspeed":
            raise ValueError(
                f"{path} is not a DeepSpeed checkpoint (layout {layout}); a Megatron checkpoint resumes with "
                "trainer.backend=megatron, or export it to HF (tools/convert_checkpoint.py megatron-to-hf) first"
            )
        world = dist.get_world_size() if dist.is_initialized() else 1
        same_world = layout.get("world_size") == world
        if not same_world and (load_optimizer or engine.zero_optimization_partition_weights()):
            raise ValueError(
                f"{path} was saved by {layout.get('world_size')} ranks and this run has {world}: ZeRO "
                "partitions reload only under the same world size. Relaunch with that many ranks, or "
                "set checkpointing.load_optimizer=false (ZeRO-1/2: weights only, fresh Adam moments)"
            )
        try:
            load_path, _ = engine.load_checkpoint(
                str(path),
                tag=DEEPSPEED_TAG,
                load_optimizer_states=load_optimizer,
                load_lr_scheduler_states=False,
                load_module_only=not load_optimizer,
            )
        except Exception as err:  # noqa: BLE001 - name the checkpoint whatever DeepSpeed raised
            raise CheckpointReadError(f"checkpoint {path} cannot be loaded ({type(err).__name__}: {err})") from err
        if load_path is None:
            raise FileNotFoundError(f"DeepSpeed found no checkpoint in {path / DEEPSPEED_TAG}")
        rng_file = path / _RNG_DIR / f"rank{_rank()}.pt"
        if same_world and rng_file.is_file():
            set_host_rng_state(torch.load(rng_file, weights_only=False))
        return state
