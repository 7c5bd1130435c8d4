"""WeDLM on Megatron-Core: layer spec, logical-position RoPE, mask backends, losses.

* :mod:`.hf_config`   -- ``ModelArgs``: the one model description (HF config <-> Megatron).
* :mod:`.wedlm_model` -- ``build_model_chunks`` (ModelArgs + ``BuildSettings`` -> this rank's
  ``WeDLMGPTModel`` chunks, a ``GPTModel`` subclass), ``wedlm_transformer_config``.
* :mod:`.layer_spec`  -- ``get_wedlm_layer_spec`` / ``get_wedlm_block_spec`` (Megatron ModuleSpecs).
* :mod:`.attention`   -- core-attention backends: ``dense`` (SDPA + bool mask), ``flex``
  (FlexAttention + BlockMask), ``te`` (Transformer Engine arbitrary mask).
* :mod:`.attention_backends` -- the one table of backends (name -> core-attention ``ModuleSpec``
  params, HF attention, row padding, CUDA, CP) and the ``auto`` rule.
* :mod:`.rope`        -- ``LogicalRotaryEmbedding``: RoPE from per-slot logical positions.
* :mod:`.norms`       -- ``WeDLMNorm``: RMSNorm/LayerNorm that supports sequence parallelism.
* :mod:`.losses`      -- ``wedlm_loss``, global normalisation, step loss reports.

Imports are lazy (PEP 562): ``megatron_wedlm.model.hf_config`` and other light submodules can
be used without importing Megatron-Core.
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
