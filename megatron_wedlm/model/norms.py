"""RMSNorm / LayerNorm usable with tensor + sequence parallelism on any device.

Why this exists: Megatron's local layer spec builds norms through ``WrappedTorchNorm``, which
asserts ``not config.sequence_parallel``; the SP-capable norms (Transformer Engine, Apex) need
CUDA. A norm is a per-token operation, so sequence parallelism needs nothing special in the
forward pass. What it does need is the gradient of the (replicated) weight: under SP each
tensor-parallel rank sees only its slice of the sequence, so its weight gradient is a partial
sum. Megatron's ``finalize_model_grads`` all-reduces across the TP group the gradients of every
parameter carrying ``sequence_parallel = True`` (distributed/finalize_model_grads.py,
``_allreduce_non_tensor_model_parallel_grads``); we set that attribute exactly as TE's norms
do. QK-norm weights (Qwen3) are reduced there too, by name (``q_layernorm`` / ``k_layernorm``),
because each TP rank normalises different heads with the same weight.

Parameter names (``weight``, ``bias``) match ``torch.nn.RMSNorm`` / ``torch.nn.LayerNorm``, so
checkpoints of the stock local spec load unchanged, and the arithmetic is the same
``torch.nn.functional`` call, so results are bit-identical to the stock norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["WeDLMNorm"]


class WeDLMNorm(torch.nn.Module):
    """``RMSNorm`` or ``LayerNorm`` (from ``config.normalization``) with SP-aware weights.

    The constructor takes the same arguments as Megatron's norm modules, so it drops into a
    ``TransformerLayerSubmodules`` / ``TransformerBlockSubmodules`` spec.
    """

    def __init__(
        self,
        config,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str | None = None,
    ) -> None:
        super().__init__()
        kind = normalization or config.normalization
        if kind not in ("RMSNorm", "LayerNorm"):
            raise ValueError(f"WeDLMNorm supports normalization 'RMSNorm' or 'LayerNorm', got {kind!r}")
        if zero_centered_gamma or config.layernorm_zero_centered_gamma:
            raise ValueError("WeDLMNorm does not implement zero-centered gamma; set layernorm_zero_centered_gamma=False")
        self.kind = kind
        self.eps = eps
        self.hidden_size = hidden_size
        device = "cpu" if config.use_cpu_initialization or not torch.cuda.is_available() else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype, device=device))
        if kind == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype, device=device))
        else:
            self.register_parameter("bias", None)
        for param in self.parameters():
            # Read by finalize_model_grads: all-reduce this grad across TP when SP is on.
            setattr(param, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x: Tensor) -> Tensor:
        if self.kind == "RMSNorm":
            return F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)
        return F.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.kind}({self.hidden_size}, eps={self.eps})"
