"""RMSNorm / LayerNorm usable with tensor + sequence parallelism on any device.

Megatron's local spec builds ``WrappedTorchNorm``, which refuses sequence parallelism, and the
SP-capable norms need CUDA. Under SP a norm's weight gradient is partial per TP rank, so the
weights carry ``sequence_parallel = True``, as TE's do, for ``finalize_model_grads`` to
all-reduce. Parameter names and arithmetic are ``torch.nn``'s: results equal the stock norm's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["WeDLMNorm"]


class WeDLMNorm(torch.nn.Module):
    """``RMSNorm`` or ``LayerNorm`` (``config.normalization``) with SP-aware weights; takes
    Megatron's norm-module arguments.
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
