"""The attention backends, in one table: every name a config, a layer spec or the DeepSpeed
path accepts, and what it means there.

A row (:class:`AttentionBackend`) gives a backend's core-attention ``ModuleSpec`` (module and
params, overridable by name), its HF ``attn_implementation``, row padding, and whether it needs
CUDA or runs under CP. ``auto`` is a rule (:func:`resolve_attention_backend`). Imports neither
torch nor Megatron, so the config schema can check names against it.
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
        """The core attention as ``ModuleSpec(module, params)``; ``options`` override defaults."""
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
    """``auto`` and the backends ``where`` accepts."""
    return (AUTO, *(name for name, backend in ATTENTION_BACKENDS.items() if where is None or where(backend)))


#: every name a config accepts: ``auto`` and the backends
ATTENTION_BACKEND_NAMES: tuple[str, ...] = backend_names()


def get_attention_backend(name: str) -> AttentionBackend:
    """The row of a resolved name (not ``auto``); ValueError listing the names otherwise."""
    backend = ATTENTION_BACKENDS.get(name)
    if backend is None:
        if name == AUTO:
            raise ValueError("attention_backend='auto' names a backend only for a device: resolve_attention_backend")
        raise ValueError(f"attention_backend={name!r} is not one of {', '.join(ATTENTION_BACKEND_NAMES)}")
    return backend


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """The backend on ``device``: ``auto`` is flex on CUDA and dense elsewhere."""
    if name == AUTO:
        return "flex" if device.type == "cuda" else "dense"
    backend = get_attention_backend(name)
    if backend.needs_cuda and device.type != "cuda":
        usable = backend_names(lambda b: not b.needs_cuda)
        raise ValueError(f"attention_backend={name!r} needs a CUDA device; on {device.type} use {', '.join(usable)}")
    return name
