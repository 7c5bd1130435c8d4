"""Every difference between the Megatron-Core releases this code base supports
(:data:`SUPPORTED_RELEASES`), one named entry each, naming the releases and the upstream function
it stands in for, so it can go when the oldest release no longer needs it; callers never test
versions. The native-torch Adam entries (used without Apex/TE) are no-ops with Apex/TE.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = [
    "CHECKPOINT_WRITE_FAILURE_MARKERS",
    "SUPPORTED_RELEASES",
    "inner_optimizers",
    "megatron_core_version",
    "patch_native_adam_step_restore",
    "prepare_optimizer_for_load",
    "save_torch_dist",
    "separate_adam_step_counters",
    "write_results_queue_attribute",
]

#: The Megatron-Core releases this code base is tested on (setup.py allows the range between).
SUPPORTED_RELEASES: tuple[str, ...] = ("0.16.1", "0.19.2")

#: Text of a failed checkpoint write that names neither ENOSPC nor the writer's own message.
#: 0.19.2's ``write_preloaded_data_multiproc`` logs the writer's exception and raises
#: ``RuntimeError("Worker failure: An error is caught while starting worker N, error: <class ...>")``.
CHECKPOINT_WRITE_FAILURE_MARKERS: tuple[str, ...] = ("An error is caught while starting worker",)


def megatron_core_version() -> str:
    """The installed release from the package metadata (all releases: ``megatron.core.__version__``
    appends the commit of any git checkout the package sits in)."""
    from importlib import metadata

    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:  # a source checkout on PYTHONPATH
        import megatron.core

        return str(getattr(megatron.core, "__version__", "unknown")).split("+")[0]


#: The legacy file of a torch_dist checkpoint's common state, and its entry in metadata.json
#: (``dist_checkpointing/strategies/common.py`` in 0.16.1 and 0.19.2).
_COMMON_STATE_FILE = "common.pt"
_COMMON_BACKEND = {"common_backend": "torch", "common_backend_version": 1}


def save_torch_dist(sharded_state_dict: dict[str, Any], directory: str) -> None:
    """``dist_checkpointing.save`` in a form every supported release loads: where 0.19.2 writes no
    ``common.pt`` (which 0.16.1's ``load_common_state_dict`` needs), rank 0 adds it as 0.16.1 does."""
    import json

    import torch
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(sharded_state_dict, directory)
    root = Path(directory)
    distributed = torch.distributed.is_initialized()
    # The save ended in a barrier, so every rank sees the same files now; the barrier below keeps
    # rank 0 from writing before the others have looked (they would skip the last barrier).
    written = (root / _COMMON_STATE_FILE).exists()
    if distributed:
        torch.distributed.barrier()
    if written:
        return
    if not distributed or torch.distributed.get_rank() == 0:
        common = dist_checkpointing.load_common_state_dict(directory)
        torch.save(common, root / _COMMON_STATE_FILE)
        metadata = json.loads((root / "metadata.json").read_text())
        (root / "metadata.json").write_text(json.dumps({**metadata, **_COMMON_BACKEND}))
    if distributed:
        torch.distributed.barrier()


def write_results_queue_attribute() -> str | None:
    """The name, in ``filesystem_async``, of the factory of the queue its checkpoint writers report
    through (0.16.1 ``_get_write_results_queue``; 0.19.2 made it public), or None if neither."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    for name in ("get_write_results_queue", "_get_write_results_queue"):
        if callable(getattr(filesystem_async, name, None)):
            return name
    return None


def _uses_native_torch_adam() -> bool:
    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer

    return not getattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)


def inner_optimizers(optimizer: Any) -> list[Any]:
    """The per-group Megatron optimizers behind a (possibly chained) optimizer."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def prepare_optimizer_for_load(optimizer: Any) -> None:
    """Give a never-stepped native-torch Adam the state ``sharded_state_dict(is_loading=True)``
    asserts (a ``step`` per parameter), as Megatron's ``init_state_fn`` fills it, plus ``step = 0``."""
    if not _uses_native_torch_adam():
        return
    import torch

    for sub in inner_optimizers(optimizer):
        init_state = getattr(sub, "init_state_fn", None)
        inner = getattr(sub, "optimizer", None)
        if init_state is None or inner is None:
            continue
        init_state(inner, getattr(sub, "config", None))
        for state in inner.state.values():
            state.setdefault("step", torch.tensor(0.0))


def patch_native_adam_step_restore(optimizer: Any) -> None:
    """Make ``DistributedOptimizer._set_main_param_and_optimizer_states`` keep ``step`` when loaded
    tensors carry only param/moments (else ``KeyError: 'step'``; the step comes from param groups)."""
    if not _uses_native_torch_adam():
        return
    for sub in inner_optimizers(optimizer):
        original = getattr(sub, "_set_main_param_and_optimizer_states", None)
        if original is None or getattr(original, "_wedlm_keeps_step", False):
            continue

        def set_states(model_param, tensors, _original=original, _sub=sub):
            group, order = _sub.model_param_group_index_map[model_param]
            state = _sub.optimizer.state[_sub.optimizer.param_groups[group]["params"][order]]
            if "step" in state and "step" not in tensors:
                tensors = {**tensors, "step": state["step"]}
            return _original(model_param, tensors)

        set_states._wedlm_keeps_step = True  # type: ignore[attr-defined]
        sub._set_main_param_and_optimizer_states = set_states


def separate_adam_step_counters(optimizer: Any) -> None:
    """After loading: one ``step`` tensor per parameter. The loader shares one tensor, which AdamW
    increments in place once per parameter, so bias correction would silently go wrong."""
    if not _uses_native_torch_adam():
        return
    import torch

    for sub in inner_optimizers(optimizer):
        inner = getattr(sub, "optimizer", None)
        if inner is None:
            continue
        for state in inner.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
