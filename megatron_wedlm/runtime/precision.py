"""Whether a device computes bf16 matrix multiplies natively (CUDA; CPUs with AVX512-BF16 or AMX),
which decides whether bf16 pays: elsewhere bf16 matmuls are emulated and slower than fp32.
"""

from __future__ import annotations

import torch

__all__ = ["native_bf16", "native_bf16_reason"]


def native_bf16_reason(device: torch.device) -> str | None:
    """What makes bf16 native on ``device`` ("AVX512-BF16", "AMX", "CUDA"), or None."""
    if device.type == "cuda":
        return "CUDA" if torch.cuda.is_bf16_supported() else None
    if device.type != "cpu":
        return None
    cpu = torch.cpu
    if getattr(cpu, "_is_amx_tile_supported", lambda: False)():
        return "AMX"
    if getattr(cpu, "_is_avx512_bf16_supported", lambda: False)():
        return "AVX512-BF16"
    return None


def native_bf16(device: torch.device) -> bool:
    """True when ``device`` multiplies bf16 matrices natively."""
    return native_bf16_reason(device) is not None
