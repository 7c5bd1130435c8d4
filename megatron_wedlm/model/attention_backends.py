"""The attention backends, in one table: every name a config, a layer spec or the DeepSpeed path
accepts, and what each name means there.

A row (:class:`AttentionBackend`) says, for one backend:

* its core attention for Megatron's ``SelfAttention``: a module (:mod:`.attention`) and the
  ``ModuleSpec`` params it is built with (the backend's options, with their defaults; callers
  override them by name, e.g. ``tile_size``) -- Megatron-Core's own way to configure a submodule;
* its transformers ``attn_implementation`` on the DeepSpeed path (HF models), or None where the
  backend has none there;
* what rows are padded to on that path (a FlexAttention ``BlockMask`` needs whole tiles);
* whether it needs CUDA and whether it runs under context parallelism.

``auto`` is not a backend but a rule (:func:`resolve_attention_backend`): flex on GPU, dense on
CPU. Configs accept it (:data:`ATTENTION_BACKEND_NAMES`); a layer spec takes a resolved name.

Why one table: every consumer (config schema, layer spec, DeepSpeed path) reads the names and
options from here, so adding a backend or an option means adding it here only, and no list of
names can fall out of step with another. The module is light to import (no torch, no Megatron at
import time), so the config schema validates names against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch
    from megatron.core.transformer.spec_utils import ModuleSpec

__all__ = [
    "ATTENTION_BACKENDS",
    "ATTENTION_BACKEND_NAMES",
    "AUTO",
    "AttentionBackend",
    "backend_names",
    "get_attention_backend",
    "resolve_attention_backend",
]

AUTO = "auto"
FLEX_TILE_SIZE = 128  # the flex BlockMask tile: the module's default and the DeepSpeed path's row padding


# The backend classes are imported when a spec is built: .attention imports torch, this table must not.
def _dense() -> type:
    from .attention import WeDLMSDPAttention

    return WeDLMSDPAttention


def _flex() -> type:
    from .attention import WeDLMFlexAttention

    return WeDLMFlexAttention


def _te() -> type:
    from .attention import te_attention_class

    return te_attention_class()  # imports Transformer Engine: only ever reached on a CUDA machine


@dataclass(frozen=True)
class AttentionBackend:
    """One attention backend (a row of :data:`ATTENTION_BACKENDS`)."""

    name: str
    module: Callable[[], type]  # the core-attention class, imported when a spec is built
    params: dict[str, Any] = field(default_factory=dict)  # its ModuleSpec params, with defaults
    hf_attn_implementation: str | None = None  # transformers attn_implementation (DeepSpeed path)
    pad_rows_to: int = 1  # DeepSpeed path: rows padded to a multiple of this
    needs_cuda: bool = False
    context_parallel: bool = True

    def core_attention_spec(self, **options: Any) -> ModuleSpec:
        """The core attention as ``ModuleSpec(module, params)``; ``options`` override the defaults."""
        from megatron.core.transformer.spec_utils import ModuleSpec

        unknown = sorted(set(options) - set(self.params))
        if unknown:
            takes = ", ".join(self.params) if self.params else "no options"
            raise ValueError(
                f"attention backend {self.name!r} has no option {', '.join(unknown)}; it takes {takes}"
            )
        return ModuleSpec(module=self.module(), params={**self.params, **options})


ATTENTION_BACKENDS: dict[str, AttentionBackend] = {
    backend.name: backend
    for backend in (
        # SDPA with the boolean mask, empty key tiles skipped (tile_size 0: one call); CPU and GPU.
        AttentionBackend("dense", _dense, {"tile_size": 64}, hf_attn_implementation="sdpa"),
        # Block-sparse FlexAttention; compile_kernel None = compiled on CUDA, eager elsewhere.
        AttentionBackend(
            "flex", _flex, {"tile_size": FLEX_TILE_SIZE, "compile_kernel": None},
            hf_attn_implementation="flex_attention", pad_rows_to=FLEX_TILE_SIZE,
        ),
        # Transformer Engine with an arbitrary mask; its CP kernels take causal/padding masks only.
        AttentionBackend("te", _te, needs_cuda=True, context_parallel=False),
    )
}


def backend_names(where: Callable[[AttentionBackend], bool] | None = None) -> tuple[str, ...]:
    """``auto`` and the backends (those ``where`` accepts), for checks and their messages."""
    return (AUTO, *(name for name, backend in ATTENTION_BACKENDS.items() if where is None or where(backend)))


#: every name a config accepts: ``auto`` and the backends
ATTENTION_BACKEND_NAMES: tuple[str, ...] = backend_names()


def get_attention_backend(name: str) -> AttentionBackend:
    """The table's row for a resolved name (not ``auto``); ValueError listing the names otherwise."""
    backend = ATTENTION_BACKENDS.get(name)
    if backend is None:
        if name == AUTO:
            raise ValueError("attention_backend='auto' names a backend only for a device: resolve_attention_backend")
        raise ValueError(f"attention_backend={name!r} is not one of {', '.join(ATTENTION_BACKEND_NAMES)}")
    return backend


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """The backend that runs on ``device``: ``auto`` is flex on CUDA and dense elsewhere."""
    if name == AUTO:
        return "flex" if device.type == "cuda" else "dense"
    backend = get_attention_backend(name)
    if backend.needs_cuda and device.type != "cuda":
        usable = backend_names(lambda b: not b.needs_cuda)
        raise ValueError(f"attention_backend={name!r} needs a CUDA device; on {device.type} use {', '.join(usable)}")
    return name
