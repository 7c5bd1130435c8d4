"""Native-torch Adam and distributed-optimizer checkpoints: a Megatron-Core 0.16.1 gap.

Applies on any device, per optimizer instance (nothing global is patched). Without Apex or
Transformer Engine, Megatron falls back to ``torch.optim.AdamW``, whose per-parameter state
holds a ``step`` tensor. ``DistributedOptimizer.load_state_dict`` copies every key of that
state from the loaded tensors, but the checkpoint formats store only param/exp_avg/exp_avg_sq,
so loading fails with ``KeyError: 'step'`` (the step itself is restored separately from the
param groups). Also ``sharded_state_dict(is_loading=True)`` calls ``state_dict()``, which
asserts that every parameter has a ``step``, i.e. that the optimizer has stepped at least once.
:func:`prepare_optimizer_for_load` fills empty state the way Megatron's own
``init_state_fn`` does (plus ``step = 0``), and :func:`patch_native_adam_step_restore`
keeps the existing ``step`` when the loaded tensors lack it. Finally, the loader puts *one*
``step`` tensor into the state of every parameter, and ``torch.optim.AdamW`` increments each
parameter's ``step`` in place, so after a resume the shared counter grows by the number of
parameters per update and Adam's bias correction goes wrong (the resumed run silently
diverges from the uninterrupted one); :func:`separate_adam_step_counters` gives every
parameter its own copy. All three are no-ops with Apex/TE.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "inner_optimizers",
    "patch_native_adam_step_restore",
    "prepare_optimizer_for_load",
    "separate_adam_step_counters",
]


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
    for sub in inner_optimizers(optimizer):
        inner = getattr(sub, "optimizer", None)
        if inner is None:
            continue
        for state in inner.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
