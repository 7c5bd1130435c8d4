"""Whether a device computes bf16 matrix multiplies natively, which decides whether bf16 pays.

On a GPU bf16 is the usual training precision. On a CPU it pays only where the cores have bf16
matrix instructions (x86: AVX512-BF16 or AMX), which run a bf16 matmul faster than an fp32 one,
and only for a model whose step is mostly matmuls (a real checkpoint): a tiny model's step is
mostly elementwise ops, which bf16 makes slower by the casts. Without those instructions bf16
matmuls are emulated and slower than fp32. ``tools/bench_train_step.py --bf16`` measures both
effects on the machine at hand; docs/results.md has figures.
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
    """True when ``device`` multiplies bf16 matrices natively (see the module docstring)."""
    return native_bf16_reason(device) is not None
