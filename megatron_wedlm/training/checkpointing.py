"""Megatron ``torch_dist`` checkpoints: weights, the optimizer state in the ``fully_reshardable``
format (reloads under any TP/PP/DP) and RNG states; naming and publication: :mod:`.checkpoint_index`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_wedlm.runtime.atomic_output import disk_full_is_named
from megatron_wedlm.runtime.megatron_compat import prepare_optimizer_for_load, save_torch_dist, separate_adam_step_counters

from .checkpoint_index import (
    CheckpointDirectory,
    CheckpointReadError,
    host_rng_state,
    read_trainer_state,
    set_host_rng_state,
)

__all__ = ["CheckpointManager", "OPTIMIZER_METADATA"]

OPTIMIZER_METADATA = {
    "distrib_optim_sharding_type": "fully_reshardable",
    # gathers optimizer shards with gloo on CPU buffers: no CUDA needed, lower GPU memory
    "distrib_optim_fully_reshardable_mem_efficient": True,
}


def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {**host_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    set_host_rng_state(state)
    get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_sharded_object(state: dict[str, Any] | None):
    """RNG state of this (pp, tp) rank; its DP and CP peers are replicas."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject(
        "rng_state",
        state,
        (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()),
        (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
        replica_id=ps.get_data_parallel_rank(with_context_parallel=True),
    )


def _layout() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
    }


class CheckpointManager(CheckpointDirectory):
    """Saves and loads Megatron checkpoints under ``root``."""

    def save(
        self,
        step: int,
        model,
        optimizer,
        trainer_state: dict[str, Any],
        files: dict[str, str | Path],
    ) -> Path:
        """Collective. ``model``: the unwrapped chunk; ``files``: written by rank 0, name -> text or -> a
        file to copy."""
        final, partial = self.begin_save(step)
        model_sd = model.sharded_state_dict()
        optimizer_sd = optimizer.sharded_state_dict(model_sd, is_loading=False, metadata=OPTIMIZER_METADATA)
        # the memory-efficient format gathers parameter state on DP rank 0; the others hold None
        # (per optimizer: a MoE model chains a dense and an expert one, keyed 0 and 1)
        for part in (optimizer_sd.values() if 0 in optimizer_sd else [optimizer_sd]):
            if part.get("param_state", ...) is None:
                del part["param_state"]
        sharded = {"model": model_sd, "optimizer": optimizer_sd, "rng_state": _rng_sharded_object(_rng_state())}
        with disk_full_is_named(partial):
            save_torch_dist(sharded, str(partial))
        state = {**trainer_state, "step": step, "layout": _layout(), "optimizer_metadata": OPTIMIZER_METADATA}
        return self.finish_save(partial, final, state, files)

    # -- loading -----------------------------------------------------------------------------

    def load(self, path: str | Path, model, optimizer, load_optimizer: bool = True) -> dict[str, Any]:
        """Load weights (optimizer and RNG when asked and possible) resharded to this layout; returns
        the trainer state."""
        from megatron.core import dist_checkpointing

        path = Path(path)
        state = read_trainer_state(path)
        same_layout = state.get("layout") == _layout()
        model_sd = model.sharded_state_dict()
        request: dict[str, Any] = {"model": model_sd}
        if load_optimizer:
            prepare_optimizer_for_load(optimizer)
            request["optimizer"] = optimizer.sharded_state_dict(
                model_sd, is_loading=True, metadata=state.get("optimizer_metadata", OPTIMIZER_METADATA)
            )
        if same_layout:
            # RNG streams belong to (pp, tp) ranks; under another layout they have no counterpart
            request["rng_state"] = _rng_sharded_object(None)
        try:
            loaded = dist_checkpointing.load(request, str(path))
        except Exception as err:  # noqa: BLE001 - name the checkpoint whatever the reader raised
            raise CheckpointReadError(f"checkpoint {path} cannot be loaded ({type(err).__name__}: {err})") from err
        model.load_state_dict(loaded["model"])
        if load_optimizer:
            optimizer.load_state_dict(loaded["optimizer"])
            separate_adam_step_counters(optimizer)
        elif hasattr(optimizer, "reload_model_params"):
            optimizer.reload_model_params()  # main (fp32) params from the loaded weights
        if same_layout and loaded.get("rng_state") is not None:
            _set_rng_state(loaded["rng_state"])
        return state
