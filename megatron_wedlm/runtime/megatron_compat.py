"""Where this code base meets Megatron-Core releases that differ, or that lack something it needs.

The one place for version differences (the CPU runtime's redirections of CUDA calls live in
:mod:`megatron_wedlm.runtime.cpu`, which names their lines per release). Each entry names the
releases it covers and the upstream function it stands in for, so it can be deleted when the
oldest supported release no longer needs it. Supported: :data:`SUPPORTED_RELEASES`.

| entry | releases | upstream |
|---|---|---|
| :func:`megatron_core_version` | all | ``megatron.core.__version__`` appends the commit of any git tree the package sits in |
| :func:`write_results_queue_attribute` | 0.16.1: ``_get_write_results_queue``; 0.19.2: ``get_write_results_queue`` | ``dist_checkpointing/strategies/filesystem_async.py`` |
| :func:`save_torch_dist` | 0.19.2 | ``dist_checkpointing.save`` keeps the common (non-sharded) state inside the torch_dist files and writes no ``common.pt``, which 0.16.1's ``load_common_state_dict`` needs |
| :data:`CHECKPOINT_WRITE_FAILURE_MARKERS` | 0.19.2 | ``FileSystemWriterAsync.write_preloaded_data_multiproc`` reports a failed writer by its exception's class alone |
| :func:`prepare_optimizer_for_load`, :func:`patch_native_adam_step_restore`, :func:`separate_adam_step_counters` | 0.16.1, 0.19.2 | ``DistributedOptimizer._set_main_param_and_optimizer_states`` with native-torch Adam |

Native-torch Adam and distributed-optimizer checkpoints (the last row). Applies on any device, per
optimizer instance (nothing global is patched). Without Apex or Transformer Engine, Megatron falls
back to ``torch.optim.AdamW``, whose per-parameter state holds a ``step`` tensor.
``DistributedOptimizer.load_state_dict`` copies every key of that state from the loaded tensors,
but the checkpoint formats store only param/exp_avg/exp_avg_sq, so loading fails with
``KeyError: 'step'`` (the step itself is restored separately from the param groups). Also
``sharded_state_dict(is_loading=True)`` calls ``state_dict()``, which asserts that every parameter
has a ``step``, i.e. that the optimizer has stepped at least once. :func:`prepare_optimizer_for_load`
fills empty state the way Megatron's own ``init_state_fn`` does (plus ``step = 0``), and
:func:`patch_native_adam_step_restore` keeps the existing ``step`` when the loaded tensors lack it.
Finally, the loader puts *one* ``step`` tensor into the state of every parameter, and
``torch.optim.AdamW`` increments each parameter's ``step`` in place, so after a resume the shared
counter grows by the number of parameters per update and Adam's bias correction goes wrong (the
resumed run silently diverges from the uninterrupted one); :func:`separate_adam_step_counters`
gives every parameter its own copy. All three are no-ops with Apex/TE.
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
    """The installed release, as its distribution names it.

    ``megatron.core.__version__`` appends the commit of whatever git checkout its files sit in (a
    virtual environment inside this repository reads ``0.19.2+<our commit>``), so the package
    metadata is the one that names the release.
    """
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
    """``dist_checkpointing.save``, in a form every supported release loads.

    Under a release that wrote no ``common.pt`` (0.19.2), rank 0 writes the common state it saved
    to ``common.pt`` and names it in ``metadata.json``, as 0.16.1 does; 0.19.2's loader reads that
    file first when it is there, so both releases load the same state.
    """
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
    """Give a never-stepped native-torch Adam the state ``sharded_state_dict(is_loading=True)`` needs."""
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
    """Make ``DistributedOptimizer`` keep ``step`` when loaded tensors carry only param/moments."""
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
    """After loading: one ``step`` tensor per parameter state (see the module docstring)."""
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
