"""Training checkpoints: Megatron ``torch_dist`` for tensors, JSON/YAML for everything else.

Layout of ``<checkpointing.dir>/iter_0000015/``:

* the ``dist_checkpointing`` files (``metadata.json``, ``*.distcp``, ``common.pt``): model
  weights, optimizer state (Megatron's ``fully_reshardable`` distributed-optimizer format, so
  a checkpoint reloads under any TP/PP/DP) and RNG states;
* ``trainer_state.json``: step, scheduler, data position of every stream, counters, layout;
* ``config.yaml``: the run's resolved config; ``wedlm_model.json``: the model description
  (what ``model.init_from`` and ``tools/convert_checkpoint.py megatron-to-hf`` read).

Atomicity: everything is written into ``iter_N.partial`` and the directory is renamed to
``iter_N`` only after every rank finished and the trainer state is on disk. A process killed
mid-save leaves a ``.partial`` directory that resume ignores and the next save removes, so the
newest *complete* checkpoint is always loadable. ``latest_checkpointed_iteration.txt`` is a
convenience for humans and Megatron-LM tools; resume scans the directories instead.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .megatron_compat import prepare_optimizer_for_load, separate_adam_step_counters

__all__ = [
    "CheckpointManager",
    "TRAINER_STATE_FILE",
    "checkpoint_name",
    "complete_checkpoints",
    "find_latest_checkpoint",
    "host_rng_state",
    "is_complete_checkpoint",
    "resolve_resume_path",
    "set_host_rng_state",
]

TRAINER_STATE_FILE = "trainer_state.json"
CONFIG_FILE = "config.yaml"
LATEST_FILE = "latest_checkpointed_iteration.txt"
PARTIAL_SUFFIX = ".partial"
_NAME = re.compile(r"^iter_(\d{7,})$")
OPTIMIZER_METADATA = {
    "distrib_optim_sharding_type": "fully_reshardable",
    # gathers optimizer shards with gloo on CPU buffers: no CUDA needed, lower GPU memory
    "distrib_optim_fully_reshardable_mem_efficient": True,
}


def checkpoint_name(step: int) -> str:
    return f"iter_{step:07d}"


def is_complete_checkpoint(path: Path) -> bool:
    return path.is_dir() and _NAME.match(path.name) is not None and (path / TRAINER_STATE_FILE).is_file()


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _NAME.match(child.name)
        if match and is_complete_checkpoint(child):
            found.append((int(match.group(1)), child))
    return sorted(found)


def find_latest_checkpoint(root: str | Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def resolve_resume_path(resume: str, root: str | Path) -> Path | None:
    """``none`` -> None; ``auto`` -> the newest complete checkpoint under ``root`` (or None);
    anything else is a checkpoint directory that must be complete."""
    if resume == "none":
        return None
    if resume == "auto":
        return find_latest_checkpoint(root)
    path = Path(resume)
    if path.is_dir() and not _NAME.match(path.name):
        latest = find_latest_checkpoint(path)  # a checkpoints root was given
        if latest is not None:
            return latest
    if not is_complete_checkpoint(path):
        raise FileNotFoundError(
            f"checkpointing.resume={resume!r} is not a complete checkpoint (an iter_NNNNNNN directory "
            f"holding {TRAINER_STATE_FILE}); use 'auto' to pick the newest complete one"
        )
    return path


def host_rng_state() -> dict[str, Any]:
    """The process's python, numpy, torch (and CUDA) generators: what exact resume restores
    under either backend (the Megatron path adds its model-parallel tracker)."""
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_host_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {**host_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    set_host_rng_state(state)
    get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_sharded_object(state: dict[str, Any] | None):
    """RNG state of this (pp, tp) rank; data-parallel peers are replicas (their states agree)."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject(
        "rng_state",
        state,
        (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()),
        (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
        replica_id=ps.get_data_parallel_rank(),
    )


def _layout() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
    }


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class CheckpointManager:
    """Saves and loads training checkpoints under ``root``; rank 0 does the file-system moves."""

    def __init__(self, root: str | Path, keep_last: int = 3) -> None:
        self.root = Path(root)
        self.keep_last = keep_last
        self.is_writer = not dist.is_initialized() or dist.get_rank() == 0

    # -- saving ------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        model,
        optimizer,
        trainer_state: dict[str, Any],
        files: dict[str, str],
    ) -> Path:
        """Collective: every rank calls it. ``model`` is the unwrapped chunk; ``files`` are
        extra text files (name -> content) written by rank 0, e.g. config.yaml."""
        from megatron.core import dist_checkpointing

        final, partial = self.begin_save(step)
        model_sd = model.sharded_state_dict()
        optimizer_sd = optimizer.sharded_state_dict(model_sd, is_loading=False, metadata=OPTIMIZER_METADATA)
        if optimizer_sd.get("param_state", ...) is None:
            # the memory-efficient format gathers parameter state on DP rank 0; the others hold None
            del optimizer_sd["param_state"]
        sharded = {"model": model_sd, "optimizer": optimizer_sd, "rng_state": _rng_sharded_object(_rng_state())}
        dist_checkpointing.save(sharded, str(partial))
        state = {**trainer_state, "step": step, "layout": _layout(), "optimizer_metadata": OPTIMIZER_METADATA}
        return self.finish_save(partial, final, state, files)

    def begin_save(self, step: int) -> tuple[Path, Path]:
        """Collective: ``(final, partial)`` for ``step``, with ``partial`` freshly created (and the
        leftovers of killed saves removed) before any rank writes into it."""
        final = self.root / checkpoint_name(step)
        partial = final.with_name(final.name + PARTIAL_SUFFIX)
        if self.is_writer:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(f"*{PARTIAL_SUFFIX}"):
                shutil.rmtree(stale, ignore_errors=True)  # left by a save that was killed
            partial.mkdir()
        _barrier()
        return final, partial

    def finish_save(self, partial: Path, final: Path, state: dict[str, Any], files: dict[str, str]) -> Path:
        """Collective, after every rank wrote its tensors: rank 0 writes ``files`` and the trainer
        state (last, it marks the checkpoint complete), publishes and prunes."""
        _barrier()
        if self.is_writer:
            for name, content in files.items():
                (partial / name).write_text(content)
            (partial / TRAINER_STATE_FILE).write_text(json.dumps(state, indent=1, sort_keys=True) + "\n")
            self.publish(partial, final)
            self.prune()
        _barrier()
        return final

    def publish(self, partial: Path, final: Path) -> None:
        """The commit point: the checkpoint becomes visible under its final name."""
        if final.exists():
            # an abandoned future of an earlier resume: replace it
            doomed = final.with_name(final.name + ".replaced")
            os.replace(final, doomed)
            os.replace(partial, final)
            shutil.rmtree(doomed, ignore_errors=True)
        else:
            os.replace(partial, final)
        _fsync_dir(self.root)
        latest_tmp = self.root / (LATEST_FILE + ".tmp")
        latest_tmp.write_text(f"{_NAME.match(final.name).group(1).lstrip('0') or '0'}\n")  # type: ignore[union-attr]
        os.replace(latest_tmp, self.root / LATEST_FILE)

    def prune(self) -> None:
        """Delete complete checkpoints older than the newest ``keep_last`` (after a publish)."""
        if self.keep_last <= 0:
            return
        for _, path in complete_checkpoints(self.root)[: -self.keep_last]:
            shutil.rmtree(path, ignore_errors=True)

    # -- loading -----------------------------------------------------------------------------

    def load(self, path: str | Path, model, optimizer, load_optimizer: bool = True) -> dict[str, Any]:
        """Load weights (and optimizer and RNG when asked and possible) into this layout; return
        the trainer state. Model and optimizer reshard to the current TP/PP/DP."""
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
        loaded = dist_checkpointing.load(request, str(path))
        model.load_state_dict(loaded["model"])
        if load_optimizer:
            optimizer.load_state_dict(loaded["optimizer"])
            separate_adam_step_counters(optimizer)
        elif hasattr(optimizer, "reload_model_params"):
            optimizer.reload_model_params()  # main (fp32) params from the loaded weights
        if same_layout and loaded.get("rng_state") is not None:
            _set_rng_state(loaded["rng_state"])
        return state


def read_trainer_state(path: str | Path) -> dict[str, Any]:
    file = Path(path) / TRAINER_STATE_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {TRAINER_STATE_FILE})")
    return json.loads(file.read_text())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
