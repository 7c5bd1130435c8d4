"""WeDLM on Megatron-Core: layer spec, logical-position RoPE, attention backends, losses.

The one model path is ``ModelArgs`` (:mod:`.hf_config`) + ``BuildSettings`` ->
:func:`.wedlm_model.build_model_chunks` (docs/architecture.md). Imports are lazy (PEP 562), so
light submodules such as :mod:`.hf_config` load without Megatron-Core.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ATTENTION_BACKENDS": "attention_backends",
    "get_wedlm_block_spec": "layer_spec",
    "get_wedlm_layer_spec": "layer_spec",
    "LossNormalizer": "losses",
    "WeDLMLoss": "losses",
    "WeDLMLossSummary": "losses",
    "global_loss_normalizer": "losses",
    "reduce_loss_reports": "losses",
    "wedlm_labels": "losses",
    "wedlm_loss": "losses",
    "WeDLMNorm": "norms",
    "LogicalRotaryEmbedding": "rope",
    "ModelArgs": "hf_config",
    "BuildSettings": "wedlm_model",
    "ModelChunks": "wedlm_model",
    "WeDLMGPTModel": "wedlm_model",
    "build_model_chunks": "wedlm_model",
    "build_wedlm_model": "wedlm_model",
    "wedlm_transformer_config": "wedlm_model",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
